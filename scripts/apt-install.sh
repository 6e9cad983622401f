#!/usr/bin/env bash
# Installs the Debian packages named on the command line that are not
# installed yet, for the tiers that need them (root). Nothing installed
# here is started: policy-rc.d forbids package scripts to start services
# (squid, prometheus, containerd and libvirtd would otherwise take their
# system ports), and is restored afterwards. The package lists are
# refreshed only when they are missing or more than an hour old, so the
# tiers of one run share one `apt-get update`. Several runs take turns on
# dpkg's lock.
#
# Usage: apt-install.sh [--with-recommends] PACKAGE...
#        apt-install.sh --lists   (only refresh stale package lists, e.g.
#                                  before apt-get download)
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
apt=(apt-get -o DPkg::Lock::Timeout=600 -q)

# refresh_lists runs apt-get update unless the lists are less than an hour
# old. The lists lock is not covered by DPkg::Lock::Timeout: a concurrent
# update is waited for here.
refresh_lists() {
	exec 8>/run/proxyfleet-apt.lock
	flock 8
	if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mmin -60 2>/dev/null | head -1)" ]; then
		"${apt[@]}" update
	fi
}

recommends=--no-install-recommends
case "${1:-}" in
--lists)
	refresh_lists
	exit 0
	;;
--with-recommends)
	recommends=
	shift
	;;
esac

missing=()
for p in "$@"; do
	if [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != installed ]; then
		missing+=("$p")
	fi
done
if [ ${#missing[@]} -eq 0 ]; then
	exit 0
fi
if [ "$(id -u)" != 0 ]; then
	echo "apt-install: ${missing[*]} missing; installing them needs root" >&2
	exit 1
fi

backup=""
if [ -e /usr/sbin/policy-rc.d ]; then
	backup=$(mktemp /usr/sbin/policy-rc.d.pf.XXXXXX)
	cp -p /usr/sbin/policy-rc.d "$backup"
fi
restore() { if [ -n "$backup" ]; then mv -f "$backup" /usr/sbin/policy-rc.d; else rm -f /usr/sbin/policy-rc.d; fi; }
trap restore EXIT
printf '#!/bin/sh\n# written by proxyfleet scripts/apt-install.sh: keep package scripts from starting services\nexit 101\n' >/usr/sbin/policy-rc.d
chmod 755 /usr/sbin/policy-rc.d

refresh_lists
echo "apt-install: ${missing[*]}"
"${apt[@]}" install -y $recommends "${missing[@]}"
