#!/usr/bin/env bash
# Prints the version `make build` stamps into every binary
# (buildinfo.Version), derived from RELEASES (docs/upgrading.md):
#
#   HEAD is a release's commit     that release's version       0.1.0
#   any other commit               the next minor, pre-release,  0.2.0-dev+0f35821e33da
#                                  with the commit as build metadata
#   no git history at hand         the next minor, pre-release   0.2.0-dev
#
# Usage: scripts/version.sh [RELEASES]  (default: RELEASES at the
# repository's root). The commit is read in the file's directory. A line
# of RELEASES is "<major.minor.patch> <40-hex commit> <YYYY-MM-DD> <note>";
# blank lines and lines starting with # are comments. A malformed line is
# an error naming its line number.
set -euo pipefail

file=${1:-$(cd "$(dirname "$0")/.." && pwd)/RELEASES}
if [ ! -r "$file" ]; then
	echo "version.sh: cannot read $file: the release list (docs/upgrading.md)" >&2
	exit 1
fi

# versions: "<version> <commit>" per release, checked.
releases=$(awk '
	/^[ \t]*(#|$)/ { next }
	{
		if ($1 !~ /^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$/) { printf "%s:%d: version %s is not major.minor.patch\n", FILENAME, NR, $1 > "/dev/stderr"; bad = 1; next }
		if ($2 !~ /^[0-9a-f]+$/ || length($2) != 40) { printf "%s:%d: commit %s is not 40 lowercase hex digits\n", FILENAME, NR, $2 > "/dev/stderr"; bad = 1; next }
		if ($3 !~ /^[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]$/) { printf "%s:%d: date %s is not YYYY-MM-DD\n", FILENAME, NR, $3 > "/dev/stderr"; bad = 1; next }
		print $1, $2
	}
	END { exit bad }' "$file")
if [ -z "$releases" ]; then
	echo "version.sh: $file lists no release" >&2
	exit 1
fi

head=$(git -C "$(dirname "$file")" rev-parse HEAD 2>/dev/null || true)
if [ -n "$head" ]; then
	v=$(awk -v h="$head" '$2 == h { print $1; exit }' <<<"$releases")
	if [ -n "$v" ]; then
		echo "$v"
		exit 0
	fi
fi

latest=$(cut -d' ' -f1 <<<"$releases" | sort -t. -k1,1n -k2,2n -k3,3n | tail -n 1)
IFS=. read -r major minor _ <<<"$latest"
next="$major.$((minor + 1)).0-dev"
if [ -n "$head" ]; then
	next+="+${head:0:12}"
fi
echo "$next"
