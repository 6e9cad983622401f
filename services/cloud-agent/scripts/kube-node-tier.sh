#!/usr/bin/env bash
# kube-node-tier.sh IMAGES_ENV -- COMMAND...: runs COMMAND (the node tier's
# go test) next to a containerd of its own, then takes everything down.
#
# containerd gets its own root, state, socket, config and CNI directories
# under a temporary directory, and runs in a network namespace of its own
# (pfkube) joined to the host by a veth pair: the host side is
# $PFKUBE_HOST_IP, the namespace side $PFKUBE_NODE_IP, and the Pods' bridge
# network $PFKUBE_POD_CIDR is routed to the namespace. The kubelet the test
# starts joins the same namespace. The script saves the kernel settings
# the kubelet changes (vm.overcommit_memory, kernel.panic...) and restores
# them on exit, with every mount, cgroup, process and link it made.
set -euo pipefail

images_env=${1:?usage: kube-node-tier.sh IMAGES_ENV -- COMMAND...}
shift
[ "${1:-}" = -- ] && shift
# shellcheck disable=SC1090
. "$images_env"

netns=pfkube
host_if=pfkube-h
node_if=pfkube-n
host_ip=10.213.0.1
node_ip=10.213.0.2
pod_cidr=10.213.1.0/24
cgroup_root=pfkube
sysctls=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes)

dir=$(mktemp -d /tmp/proxyfleet-kube-node.XXXXXX)
containerd_pid=
declare -A saved

cleanup() {
	local rc=$?
	set +e
	if [ -S "$dir/containerd.sock" ]; then
		# Stop what the kubelet left running, so the shims exit.
		for id in $(ctr -a "$dir/containerd.sock" -n k8s.io tasks ls -q 2>/dev/null); do
			ctr -a "$dir/containerd.sock" -n k8s.io tasks kill -s SIGKILL "$id" >/dev/null 2>&1
			ctr -a "$dir/containerd.sock" -n k8s.io tasks rm -f "$id" >/dev/null 2>&1
		done
		for id in $(ctr -a "$dir/containerd.sock" -n k8s.io containers ls -q 2>/dev/null); do
			ctr -a "$dir/containerd.sock" -n k8s.io containers rm "$id" >/dev/null 2>&1
		done
	fi
	if [ -n "$containerd_pid" ]; then
		kill "$containerd_pid" 2>/dev/null
		for _ in $(seq 100); do kill -0 "$containerd_pid" 2>/dev/null || break; sleep 0.1; done
		kill -9 "$containerd_pid" 2>/dev/null
	fi
	# Shims of this containerd that are still alive (they name its socket).
	for p in /proc/[0-9]*; do
		if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -- "-address $dir/containerd.sock"; then
			kill -9 "${p#/proc/}" 2>/dev/null
		fi
	done
	findmnt -rno TARGET | grep -F "$dir/" | sort -r | while read -r m; do umount -l "$m"; done
	for key in "${!saved[@]}"; do sysctl -qw "$key=${saved[$key]}"; done
	ip route del "$pod_cidr" 2>/dev/null
	ip link del "$host_if" 2>/dev/null
	ip netns del "$netns" 2>/dev/null
	# The Pods' cgroups, deepest first.
	for c in /sys/fs/cgroup/*/"$cgroup_root"; do
		[ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} + 2>/dev/null
	done
	rm -rf "$dir"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for key in "${sysctls[@]}"; do saved[$key]=$(sysctl -n "$key"); done

# A leftover of an interrupted run would make ip fail below.
ip link del "$host_if" 2>/dev/null || true
ip netns del "$netns" 2>/dev/null || true
ip netns add "$netns"
ip link add "$host_if" type veth peer name "$node_if"
ip link set "$node_if" netns "$netns"
ip addr add "$host_ip/30" dev "$host_if"
ip link set "$host_if" up
ip -n "$netns" addr add "$node_ip/30" dev "$node_if"
ip -n "$netns" link set "$node_if" up
ip -n "$netns" link set lo up
ip -n "$netns" route add default via "$host_ip"
# Forwarding between the bridge and the veth, inside the namespace only.
ip netns exec "$netns" sysctl -qw net.ipv4.ip_forward=1
ip route add "$pod_cidr" via "$node_ip" dev "$host_if"

# The kubelet's cgroup root must exist in every hierarchy it sees.
for c in /sys/fs/cgroup/*/; do mkdir -p "$c$cgroup_root"; done

mkdir -p "$dir/cni/net.d" "$dir/cni/ipam"
cat >"$dir/cni/net.d/10-pfkube.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "pfkube",
  "plugins": [{
    "type": "bridge", "bridge": "pfkube0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
    "ipam": {"type": "host-local", "dataDir": "$dir/cni/ipam", "ranges": [[{"subnet": "$pod_cidr"}]], "routes": [{"dst": "0.0.0.0/0"}]}
  }]
}
JSON
cat >"$dir/containerd.toml" <<TOML
version = 2
root = "$dir/containerd/root"
state = "$dir/containerd/state"
[grpc]
  address = "$dir/containerd.sock"
[ttrpc]
  address = "$dir/containerd.sock.ttrpc"
[debug]
  address = "$dir/containerd-debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # The test machine may forbid lowering a process's oom_score_adj.
  restrict_oom_score_adj = true
  # Pod network namespaces under the state directory (not /run/netns), so
  # the clean-up below unmounts any a stopped sandbox left.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
TOML

nsenter --net=/run/netns/"$netns" containerd --config "$dir/containerd.toml" >"$dir/containerd.log" 2>&1 &
containerd_pid=$!
for _ in $(seq 600); do
	ctr -a "$dir/containerd.sock" version >/dev/null 2>&1 && break
	kill -0 "$containerd_pid" 2>/dev/null || { tail -40 "$dir/containerd.log"; exit 1; }
	sleep 0.1
done
ctr -a "$dir/containerd.sock" version >/dev/null
for image in "$IMAGES_DIR/pause-oci.tar" "$IMAGES_DIR/squid-oci.tar"; do
	ctr -a "$dir/containerd.sock" -n k8s.io images import "$image" >/dev/null
done
ctr -a "$dir/containerd.sock" -n k8s.io images ls -q | grep -F localhost/proxyfleet/

export PFKUBE_NETNS=/run/netns/$netns PFKUBE_HOST_IP=$host_ip PFKUBE_NODE_IP=$node_ip PFKUBE_POD_CIDR=$pod_cidr
export PFKUBE_CRI="unix://$dir/containerd.sock" PFKUBE_CGROUP_ROOT=/$cgroup_root PFKUBE_DIR=$dir
export PFKUBE_SQUID_IMAGE=$SQUID_IMAGE PFKUBE_CONTAINERD_LOG=$dir/containerd.log
set +e
"$@"
rc=$?
set -e
if [ "$rc" != 0 ]; then
	echo "--- containerd log (tail)"
	tail -30 "$dir/containerd.log"
fi
exit "$rc"
