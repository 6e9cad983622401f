package local

import (
	"crypto/md5"
	"crypto/rand"
)

const cryptAlphabet = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// htpasswdLine returns "user:$1$salt$hash", an htpasswd line in the
// MD5-crypt format that Squid's basic_ncsa_auth verifies on every platform
// (it carries its own implementation), with a fresh random salt.
func htpasswdLine(user, password string) string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("local: crypto/rand failed: " + err.Error()) // cannot happen on supported platforms
	}
	salt := make([]byte, 8)
	for i, v := range b {
		salt[i] = cryptAlphabet[v&0x3f]
	}
	return user + ":" + md5Crypt([]byte(password), salt) + "\n"
}

// md5Crypt is the FreeBSD MD5-crypt ("$1$") of password with salt (at most
// 8 characters are used).
func md5Crypt(password, salt []byte) string {
	const magic = "$1$"
	if len(salt) > 8 {
		salt = salt[:8]
	}
	alt := md5.New()
	alt.Write(password)
	alt.Write(salt)
	alt.Write(password)
	altSum := alt.Sum(nil)

	d := md5.New()
	d.Write(password)
	d.Write([]byte(magic))
	d.Write(salt)
	for i := len(password); i > 0; i -= 16 {
		d.Write(altSum[:min(i, 16)])
	}
	for i := len(password); i > 0; i >>= 1 {
		if i&1 != 0 {
			d.Write([]byte{0})
		} else {
			d.Write(password[:1])
		}
	}
	final := d.Sum(nil)
	for i := 0; i < 1000; i++ {
		r := md5.New()
		if i&1 != 0 {
			r.Write(password)
		} else {
			r.Write(final)
		}
		if i%3 != 0 {
			r.Write(salt)
		}
		if i%7 != 0 {
			r.Write(password)
		}
		if i&1 != 0 {
			r.Write(final)
		} else {
			r.Write(password)
		}
		final = r.Sum(nil)
	}
	out := []byte(magic + string(salt) + "$")
	to64 := func(v uint32, n int) {
		for ; n > 0; n-- {
			out = append(out, cryptAlphabet[v&0x3f])
			v >>= 6
		}
	}
	for _, g := range [][3]int{{0, 6, 12}, {1, 7, 13}, {2, 8, 14}, {3, 9, 15}, {4, 10, 5}} {
		to64(uint32(final[g[0]])<<16|uint32(final[g[1]])<<8|uint32(final[g[2]]), 4)
	}
	to64(uint32(final[11]), 2)
	return string(out)
}
