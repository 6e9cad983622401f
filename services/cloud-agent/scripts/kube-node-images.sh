#!/usr/bin/env bash
# kube-node-images.sh DIR [--check]: builds the two images of the Kubernetes node tier
# into DIR (a cache, keyed by the hash of this recipe) unless they are there:
#
#   squid-oci.tar  localhost/proxyfleet/squid:<hash>  Debian 12 with Debian's
#                  squid, from a minimal mmdebstrap root filesystem
#   pause-oci.tar  localhost/proxyfleet/pause:<hash>  the static pause binary
#                  of tools/pause, the Pods' sandbox
#
# Both are OCI image-layout tars (tools/ociimage) that `ctr -n k8s.io images
# import` loads without a registry; DIR/<hash>/images.env names them, and
# is the last line the script prints. With --check it builds nothing and
# says by its exit status whether they are cached. MIRROR
# (http://deb.debian.org/debian) and SECURITY_MIRROR pick the archive.
set -euo pipefail

out=${1:?usage: kube-node-images.sh DIR}
here=$(cd "$(dirname "$0")/.." && pwd) # services/cloud-agent
mirror=${MIRROR:-http://deb.debian.org/debian}
security=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
suite=bookworm
packages=squid

# The recipe: this script, the two tools and the archive it reads.
hash=$(cat "$0" $(ls "$here"/tools/ociimage/*.go "$here"/tools/pause/*.go | grep -v '_test\.go$') \
	<(echo "$mirror $security $suite $packages") |
	sha256sum | cut -c1-12)
dir=$out/$hash
if [ "${2:-}" = --check ]; then
	[ -s "$dir/images.env" ]
	exit
fi
mkdir -p "$out"
# One build at a time: a second run waits for the first and finds its
# images.
exec 9>"$out/.lock"
flock 9
if [ -s "$dir/images.env" ]; then
	echo "kube-node images $hash: cached in $dir"
	echo "$dir/images.env"
	exit 0
fi
tmp=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "kube-node images $hash: building the Squid root filesystem ($suite, $packages)"
start=$(date +%s)
mmdebstrap --quiet --mode=root --variant=essential --include="$packages" \
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
	--customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*.log' \
	"$suite" "$tmp/squid-rootfs.tar" \
	"deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main"
squid_version=$(tar -xOf "$tmp/squid-rootfs.tar" ./var/lib/dpkg/status |
	awk '/^Package: /{p=$2} /^Version: /&&p=="squid"{print $2; exit}')
echo "kube-node images $hash: squid $squid_version, root filesystem $(du -m "$tmp/squid-rootfs.tar" | cut -f1) MB in $(($(date +%s) - start))s"

(cd "$here" && go build -o "$tmp/ociimage" ./tools/ociimage)
mkdir -p "$tmp/pause-root"
(cd "$here" && CGO_ENABLED=0 go build -trimpath -ldflags=-s -o "$tmp/pause-root/pause" ./tools/pause)
tar --owner=0 --group=0 --numeric-owner -C "$tmp/pause-root" -cf "$tmp/pause-rootfs.tar" ./pause

squid_ref=localhost/proxyfleet/squid:$hash
pause_ref=localhost/proxyfleet/pause:$hash
"$tmp/ociimage" -layer "$tmp/squid-rootfs.tar" -name "$squid_ref" -user 13:13 \
	-cmd "squid -N -f /etc/squid/squid.conf" -o "$tmp/squid-oci.tar"
"$tmp/ociimage" -layer "$tmp/pause-rootfs.tar" -name "$pause_ref" -user 65535:65535 \
	-entrypoint /pause -o "$tmp/pause-oci.tar"

mkdir -p "$dir.new"
mv "$tmp/squid-oci.tar" "$tmp/pause-oci.tar" "$dir.new/"
cat >"$dir.new/images.env" <<ENV
SQUID_IMAGE=$squid_ref
SQUID_VERSION=$squid_version
PAUSE_IMAGE=$pause_ref
IMAGES_DIR=$dir
ENV
rm -rf "$dir" && mv "$dir.new" "$dir"
echo "kube-node images $hash: $squid_ref and $pause_ref in $dir"
echo "$dir/images.env"
