#!/usr/bin/env bash
# Runs a command against a real libvirtd started for it: installs libvirt,
# QEMU and OVMF when missing, creates a network namespace, starts virtlogd
# and libvirtd inside it (no systemd needed), defines a directory storage
# pool and a NAT network that exist only there, runs the command, then
# stops the daemons by PID and removes everything it made. Runs on one
# machine take turns (an flock on /run/proxyfleet-kvm-tier.lock).
#
# Usage: libvirt-tier.sh COMMAND [ARGS...]
# The command sees KVM_TEST_SOCKET, KVM_TEST_POOL, KVM_TEST_NETWORK.
set -euo pipefail

NS=${KVM_TIER_NETNS:-pfkvm}
STATE=${KVM_TIER_STATE:-/var/lib/proxyfleet-kvm-tier}
POOL=pfci
NET=pfci
SOCK=/run/libvirt/libvirt-sock
VIRSH=(virsh -q -c qemu:///system)

need_pkgs=()
command -v libvirtd >/dev/null 2>&1 || need_pkgs+=(libvirt-daemon-system)
command -v qemu-system-x86_64 >/dev/null 2>&1 || need_pkgs+=(qemu-system-x86)
command -v qemu-img >/dev/null 2>&1 || need_pkgs+=(qemu-utils)
[ -e /usr/share/OVMF/OVMF_CODE.fd ] || need_pkgs+=(ovmf)
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
command -v tini >/dev/null 2>&1 || need_pkgs+=(tini)
if [ ${#need_pkgs[@]} -gt 0 ]; then
	echo "kvm tier: installing ${need_pkgs[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q
	apt-get install -y -q "${need_pkgs[@]}"
fi
# Daemons libvirtd forks (dnsmasq, QEMU) are orphaned when they exit and
# nothing here reaps orphans (no init system): run under tini as a
# subreaper so they are reaped, not left as zombies.
if [ -z "${KVM_TIER_REAPED:-}" ]; then
	export KVM_TIER_REAPED=1
	exec tini -s -g -- "$0" "$@"
fi
if [ "$(id -u)" != 0 ]; then
	echo "kvm tier: must run as root (it starts libvirtd)" >&2
	exit 1
fi
# One tier at a time on this machine: they share the system libvirtd
# socket and the network namespace.
LOCK=${KVM_TIER_LOCK:-/run/proxyfleet-kvm-tier.lock}
exec 9>"$LOCK"
if ! flock -n 9; then
	echo "kvm tier: another run holds $LOCK; waiting for it"
	flock 9
fi
if [ -S "$SOCK" ] && "${VIRSH[@]}" version >/dev/null 2>&1; then
	echo "kvm tier: a libvirtd is already answering on $SOCK; stop it first" >&2
	exit 1
fi

mkdir -p "$STATE/pool"
pids=()
cleanup() {
	local rc=$?
	set +e
	if [ "$rc" != 0 ] && [ -f "$STATE/libvirtd.log" ]; then
		echo "kvm tier: failed ($rc); last lines of libvirtd's log:"
		grep -v 'wrong nlmsg len\|agent is not connected\|virNetSocketReadWire' "$STATE/libvirtd.log" | tail -n 30
	fi
	if [ -S "$SOCK" ]; then
		for d in $("${VIRSH[@]}" list --all --name 2>/dev/null); do
			"${VIRSH[@]}" destroy "$d" >/dev/null 2>&1
			"${VIRSH[@]}" undefine --nvram "$d" >/dev/null 2>&1
		done
		"${VIRSH[@]}" net-destroy "$NET" >/dev/null 2>&1
		"${VIRSH[@]}" net-undefine "$NET" >/dev/null 2>&1
		"${VIRSH[@]}" pool-destroy "$POOL" >/dev/null 2>&1
		"${VIRSH[@]}" pool-undefine "$POOL" >/dev/null 2>&1
	fi
	for ((i=${#pids[@]}-1; i>=0; i--)); do
		kill -TERM "${pids[$i]}" 2>/dev/null
	done
	for p in "${pids[@]}"; do
		wait "$p" 2>/dev/null
	done
	ip netns del "$NS" 2>/dev/null
	rm -rf "$STATE"
	exit "$rc"
}
trap cleanup EXIT

ip netns del "$NS" 2>/dev/null || true
ip netns add "$NS"
ip -n "$NS" link set lo up
ip netns exec "$NS" /usr/sbin/virtlogd >"$STATE/virtlogd.log" 2>&1 9>&- &
pids+=($!)
ip netns exec "$NS" /usr/sbin/libvirtd >"$STATE/libvirtd.log" 2>&1 9>&- &
pids+=($!)
for _ in $(seq 1 300); do
	[ -S "$SOCK" ] && break
	sleep 0.1
done
start=$(date +%s)
"${VIRSH[@]}" version >/dev/null
echo "kvm tier: libvirtd up (first connection $(( $(date +%s) - start ))s)"

"${VIRSH[@]}" pool-define-as "$POOL" dir --target "$STATE/pool" >/dev/null
"${VIRSH[@]}" pool-build "$POOL" >/dev/null
"${VIRSH[@]}" pool-start "$POOL" >/dev/null
cat >"$STATE/net.xml" <<NETXML
<network>
  <name>$NET</name>
  <forward mode='nat'/>
  <bridge name='pfci0' stp='off'/>
  <ip address='192.168.150.1' netmask='255.255.255.0'>
    <dhcp><range start='192.168.150.10' end='192.168.150.200'/></dhcp>
  </ip>
</network>
NETXML
"${VIRSH[@]}" net-define "$STATE/net.xml" >/dev/null
"${VIRSH[@]}" net-start "$NET" >/dev/null

export KVM_TEST_SOCKET=$SOCK KVM_TEST_POOL=$POOL KVM_TEST_NETWORK=$NET KVM_TEST_NETNS=$NS
"$@" 9>&-
