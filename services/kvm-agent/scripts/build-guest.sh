#!/usr/bin/env bash
# Builds the boot test's guest disk from Debian packages: Debian's kernel, a
# busybox initramfs whose /init loads the virtio, virtio-SCSI CD-ROM and
# ISO9660 modules (the kvm-agent attaches the seed on virtio-scsi), mounts the NoCloud seed (label cidata), gets an address with
# udhcpc, starts qemu-guest-agent (Debian's, with the libraries it links)
# and runs the seed's user-data when it is a script; a statically built
# forward proxy rides along. The disk boots under BIOS with syslinux
# (installed with mtools, no loop mounts) and is written as qcow2.
#
# Usage: build-guest.sh OUTDIR [--check]   (writes OUTDIR/guest.qcow2;
# reuses it when it was built by this version of the script and of the
# proxy; --check only says whether it would, by its exit status)
set -euo pipefail

OUT=$(realpath -m "${1:?usage: build-guest.sh OUTDIR [--check]}")
HERE=$(cd "$(dirname "$0")/.." && pwd)
# The recipe is the content of the script and of the proxy's sources, not
# their paths, so every clone on a machine shares one cached disk.
RECIPE=$(cat "$0" "$HERE/testdata/guest/fwdproxy"/*.go | sha256sum | cut -c1-16)
cached=false
if [ -s "$OUT/guest.qcow2" ] && [ "$(cat "$OUT/guest.recipe" 2>/dev/null)" = "$RECIPE" ]; then
	cached=true
fi
if [ "${2:-}" = --check ]; then
	$cached
	exit
fi
if $cached; then
	echo "guest image: $OUT/guest.qcow2 (cached, recipe $RECIPE)"
	exit 0
fi
need=()
for pair in syslinux:syslinux mcopy:mtools mkfs.vfat:dosfstools sfdisk:fdisk depmod:kmod qemu-img:qemu-utils cpio:cpio; do
	command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
[ -e /usr/lib/syslinux/mbr/mbr.bin ] || need+=(syslinux-common)
if [ ${#need[@]} -gt 0 ]; then
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q
	apt-get install -y -q "${need[@]}"
fi

W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cd "$W"
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
if [ -z "$kpkg" ]; then
	apt-get update -q
	kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
fi
apt-get download -q "$kpkg" busybox-static qemu-guest-agent >/dev/null
dpkg-deb -x "$kpkg"_*.deb k
dpkg-deb -x busybox-static_*.deb bb
dpkg-deb -x qemu-guest-agent_*.deb qga
if ldd qga/usr/sbin/qemu-ga | grep -q 'not found'; then
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q libglib2.0-0 libnuma1 liburing2 libudev1 libpcre2-8-0
fi
KVER=$(ls k/lib/modules)
depmod -b k "$KVER"

R=root
mkdir -p $R/bin $R/proc $R/sys $R/dev $R/seed $R/tmp $R/etc $R/lib/modules
cp bb/bin/busybox $R/bin/busybox
# qemu-ga with the host's copies of its libraries (same Debian release).
mkdir -p $R/usr/sbin $R/lib64 $R/lib/x86_64-linux-gnu $R/var/run $R/var/lib $R/run
cp qga/usr/sbin/qemu-ga $R/usr/sbin/
for lib in $(ldd qga/usr/sbin/qemu-ga | awk '/=> \//{print $3}'); do
	cp -L "$lib" $R/lib/x86_64-linux-gnu/
done
cp -L /lib64/ld-linux-x86-64.so.2 $R/lib64/
CGO_ENABLED=0 go build -C "$HERE" -trimpath -ldflags '-s -w' -o "$W/$R/bin/fwdproxy" ./testdata/guest/fwdproxy

# Modules in load order: each one's dependencies (modules.dep lists them
# nearest first, so load them in reverse), then itself.
declare -A seen=()
order=()
add() {
	local m=$1 line dep i deps=()
	[ -n "${seen[$m]:-}" ] && return
	seen[$m]=1
	line=$(grep -E "(^|/)$m\.ko:" "k/lib/modules/$KVER/modules.dep")
	read -r -a deps <<<"${line#*:}"
	for ((i=${#deps[@]}-1; i>=0; i--)); do
		dep=$(basename "${deps[$i]}" .ko)
		add "$dep"
	done
	order+=("${line%%:*}")
}
for m in virtio_pci virtio_net virtio_scsi sr_mod cdrom isofs virtio_console; do add "$m"; done
{
	for p in "${order[@]}"; do
		cp "k/lib/modules/$KVER/$p" "$R/lib/modules/"
		echo "insmod /lib/modules/$(basename "$p")"
	done
} >"$W/insmods"

cat >$R/etc/udhcpc.script <<'SCRIPT'
#!/bin/sh
case "$1" in
bound|renew)
	ifconfig "$interface" "$ip" netmask "${subnet:-255.255.255.0}" up
	[ -n "$router" ] && route add default gw "${router%% *}" dev "$interface"
	echo "pfguest: address $ip on $interface" >/dev/console
	;;
esac
exit 0
SCRIPT
chmod +x $R/etc/udhcpc.script

{
	cat <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "pfguest: init"
INIT
	cat "$W/insmods"
	cat <<'INIT'
ifconfig lo 127.0.0.1 up
for p in /sys/class/virtio-ports/*; do
	[ "$(cat "$p/name" 2>/dev/null)" = org.qemu.guest_agent.0 ] && GA=/dev/${p##*/}
done
if [ -n "${GA:-}" ]; then
	echo "pfguest: guest agent on $GA"
	/usr/sbin/qemu-ga -m virtio-serial -p "$GA" </dev/null >/dev/console 2>&1 &
fi
i=0
while [ ! -b /dev/sr0 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
mount -t iso9660 -o ro /dev/sr0 /seed && echo "pfguest: seed mounted"
IF=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)
ifconfig "$IF" up
udhcpc -i "$IF" -s /etc/udhcpc.script -t 30 -T 2 -b
if [ "$(head -c 2 /seed/user-data 2>/dev/null)" = "#!" ]; then
	cp /seed/user-data /tmp/user-data
	chmod +x /tmp/user-data
	echo "pfguest: running user-data"
	/tmp/user-data </dev/null >/dev/console 2>&1 &
fi
while :; do sleep 3600; done
INIT
} >$R/init
chmod +x $R/init
(cd $R && find . | cpio -o -H newc --quiet | gzip -1) >initrd.gz

# A 64 MiB disk: MBR with syslinux, one FAT partition with kernel and initrd.
truncate -s 64M disk.raw
echo 'start=2048, type=c, bootable' | sfdisk -q disk.raw
mkfs.vfat -n PFBOOT --offset 2048 disk.raw $(( (64*1024) - 1024 )) >/dev/null
syslinux --offset $((2048*512)) --install disk.raw
dd if=/usr/lib/syslinux/mbr/mbr.bin of=disk.raw bs=440 count=1 conv=notrunc status=none
cat >syslinux.cfg <<CFG
DEFAULT linux
TIMEOUT 0
PROMPT 0
LABEL linux
  KERNEL vmlinuz
  INITRD initrd.gz
  APPEND console=ttyS0 quiet panic=5
CFG
mcopy -i disk.raw@@1M "k/boot/vmlinuz-$KVER" ::vmlinuz
mcopy -i disk.raw@@1M initrd.gz ::initrd.gz
mcopy -i disk.raw@@1M syslinux.cfg ::syslinux.cfg
mkdir -p "$OUT"
qemu-img convert -q -O qcow2 disk.raw "$OUT/guest.qcow2.tmp"
rm -f "$OUT/guest.recipe"
mv "$OUT/guest.qcow2.tmp" "$OUT/guest.qcow2"
echo "$RECIPE" >"$OUT/guest.recipe"
echo "guest image: $OUT/guest.qcow2 ($(stat -c %s "$OUT/guest.qcow2") bytes, kernel $KVER)"
