package local

import (
	"strings"
	"testing"
)

// Vectors from `openssl passwd -1 -salt SALT PASSWORD`.
func TestMD5Crypt(t *testing.T) {
	cases := []struct{ password, salt, want string }{
		{"password", "abcdefgh", "$1$abcdefgh$G//4keteveJp0qb8z2DxG/"},
		{"a long password with spaces and more than sixteen chars", "x.Y/z", "$1$x.Y/z$fIsSGCIO1iDdwpfCsn2N20"},
		{"", "saltsalt", "$1$saltsalt$5Jhcit4zN9UlGiA0txPkO0"},
	}
	for _, tc := range cases {
		if got := md5Crypt([]byte(tc.password), []byte(tc.salt)); got != tc.want {
			t.Errorf("md5Crypt(%q, %q) = %q, want %q", tc.password, tc.salt, got, tc.want)
		}
	}
}

func TestHtpasswdLine(t *testing.T) {
	line := htpasswdLine("crawler", "s3cret")
	user, hash, ok := strings.Cut(strings.TrimSuffix(line, "\n"), ":")
	if !ok || user != "crawler" || !strings.HasPrefix(hash, "$1$") {
		t.Fatalf("htpasswdLine = %q, want crawler:$1$...", line)
	}
	salt := strings.Split(hash, "$")[2]
	if got := md5Crypt([]byte("s3cret"), []byte(salt)); got != hash {
		t.Fatalf("hash %q does not verify (recomputed %q)", hash, got)
	}
}
