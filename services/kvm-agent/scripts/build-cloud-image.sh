#!/usr/bin/env bash
# Builds a Debian 12 (bookworm) cloud image the way an operator's golden
# image would be: Debian's cloud kernel, systemd, cloud-init (NoCloud only,
# so it never probes a metadata address), Squid, apache2-utils (htpasswd)
# and qemu-guest-agent installed from Debian packages, DHCP with ifupdown.
# The guest needs no package mirror at boot.
#
# The disk is GPT with an EFI system partition holding a standalone GRUB at
# the removable-media path /EFI/BOOT/BOOTX64.EFI (UEFI firmware such as OVMF
# boots it without an NVRAM entry) and an ext4 root. Nothing is mounted:
# mmdebstrap writes a directory, mkfs.ext4 -d turns it into the root file
# system, mtools fills the ESP, and the pieces are written into one raw
# file, converted to qcow2.
#
# Usage: build-cloud-image.sh OUT.qcow2
# Knobs: SUITE (bookworm), MIRROR (the host's apt sources), DISK_MIB (2048).
set -euo pipefail

OUT=$(realpath -m "${1:?usage: build-cloud-image.sh OUT.qcow2}")
SUITE=${SUITE:-bookworm}
DISK_MIB=${DISK_MIB:-2048}
ESP_MIB=63

need=()
for pair in mmdebstrap:mmdebstrap mcopy:mtools mkfs.vfat:dosfstools sfdisk:fdisk qemu-img:qemu-utils grub-mkstandalone:grub-common; do
	command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
[ -d /usr/lib/grub/x86_64-efi ] || need+=(grub-efi-amd64-bin)
if [ ${#need[@]} -gt 0 ]; then
	export DEBIAN_FRONTEND=noninteractive
	apt-get -o DPkg::Lock::Timeout=600 update -q
	apt-get -o DPkg::Lock::Timeout=600 install -y -q "${need[@]}"
fi
if [ "$(id -u)" != 0 ]; then
	echo "cloud image: must run as root (mmdebstrap writes a root-owned tree)" >&2
	exit 1
fi

# Identifiers and dates derived from this script, so a rebuild of the same
# recipe gives the same file systems' UUIDs and, where the tools allow, the
# same timestamps.
RECIPE=$(sha256sum "$0" | cut -c1-32)
ROOT_UUID=$(echo "$RECIPE" | sed -E 's/^(.{8})(.{4})(.{4})(.{4})(.{12}).*/\1-\2-\3-\4-\5/')
ESP_ID=${RECIPE:0:8}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1735689600}
export E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH

W=$(mktemp -d "$(dirname "$OUT")/.cloud-image.XXXXXX")
trap 'rm -rf "$W"' EXIT
R=$W/root
mkdir -p "$R"

pkgs=(
	linux-image-cloud-amd64 systemd-sysv udev kmod
	ifupdown isc-dhcp-client iproute2 netbase ca-certificates
	cloud-init cloud-guest-utils
	squid apache2-utils qemu-guest-agent
)
mirror=()
[ -n "${MIRROR:-}" ] && mirror=("$MIRROR")
mmdebstrap --mode=root --variant=minbase --include="$(IFS=,; echo "${pkgs[*]}")" \
	--customize-hook='echo "datasource_list: [NoCloud, None]" >"$1/etc/cloud/cloud.cfg.d/90-proxyfleet-datasource.cfg"' \
	--customize-hook='printf "auto lo\niface lo inet loopback\n\nsource /etc/network/interfaces.d/*\n" >"$1/etc/network/interfaces"' \
	--customize-hook='printf "UUID='"$ROOT_UUID"' / ext4 defaults,errors=remount-ro 0 1\n" >"$1/etc/fstab"' \
	--customize-hook='printf "debian\n" >"$1/etc/hostname"; : >"$1/etc/machine-id"; rm -f "$1/var/lib/dbus/machine-id"' \
	--customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/* "$1"/var/log/*.log' \
	"$SUITE" "$R" "${mirror[@]}"

KVER=$(ls "$R/lib/modules" | sort -V | tail -n 1)
[ -f "$R/boot/vmlinuz-$KVER" ] && [ -f "$R/boot/initrd.img-$KVER" ] || {
	echo "cloud image: kernel or initrd for $KVER missing in /boot" >&2
	exit 1
}

# Standalone GRUB: its embedded grub.cfg finds the root file system by UUID
# and boots the kernel with the console on the first serial port.
cat >"$W/grub.cfg" <<CFG
set timeout=0
insmod part_gpt
insmod ext2
search --no-floppy --fs-uuid --set=root $ROOT_UUID
linux /boot/vmlinuz-$KVER root=UUID=$ROOT_UUID ro console=tty0 console=ttyS0,115200n8 net.ifnames=0
initrd /boot/initrd.img-$KVER
boot
CFG
grub-mkstandalone -O x86_64-efi -o "$W/BOOTX64.EFI" \
	--modules="part_gpt ext2 search_fs_uuid linux normal" --locales= --fonts= --themes= \
	"boot/grub/grub.cfg=$W/grub.cfg"

# ESP: FAT at 1 MiB. Root: ext4 from 64 MiB to 1 MiB before the end (the
# backup GPT lives there).
ROOT_MIB=$((DISK_MIB - 1 - ESP_MIB - 1))
mkfs.vfat -C -n ESP -i "$ESP_ID" "$W/esp.img" $((ESP_MIB * 1024)) >/dev/null
mmd -i "$W/esp.img" ::/EFI ::/EFI/BOOT
mcopy -i "$W/esp.img" "$W/BOOTX64.EFI" ::/EFI/BOOT/BOOTX64.EFI
mkfs.ext4 -q -F -L root -U "$ROOT_UUID" -E root_owner=0:0,hash_seed="$ROOT_UUID" -O ^metadata_csum_seed,^orphan_file \
	-d "$R" "$W/root.img" "${ROOT_MIB}M"

truncate -s "${DISK_MIB}M" "$W/disk.raw"
sfdisk -q "$W/disk.raw" <<PART
label: gpt
label-id: $ROOT_UUID
start=1MiB, size=${ESP_MIB}MiB, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name=ESP
start=$((1 + ESP_MIB))MiB, size=${ROOT_MIB}MiB, type=0FC63DAF-8483-4772-8E79-3D69D8C47DE4, name=root
PART
dd if="$W/esp.img" of="$W/disk.raw" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$W/root.img" of="$W/disk.raw" bs=1M seek=$((1 + ESP_MIB)) conv=notrunc,sparse status=none
mkdir -p "$(dirname "$OUT")"
qemu-img convert -q -O qcow2 "$W/disk.raw" "$OUT.tmp"
mv -f "$OUT.tmp" "$OUT"
echo "cloud image: $OUT ($(stat -c %s "$OUT") bytes, Debian $SUITE, kernel $KVER)"
