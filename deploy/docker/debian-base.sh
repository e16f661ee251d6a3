#!/usr/bin/env bash
# A base image for the Dockerfile made from Debian's own packages, for hosts that reach a Debian
# mirror but not Docker Hub (where `python:3.11-slim` lives):
#   sudo deploy/docker/debian-base.sh                      # -> splitspec-base:bookworm
#   docker build --build-arg BASE_IMAGE=splitspec-base:bookworm ...
# Debian bookworm's Python is 3.11, the same as python:3.11-slim, so the same wheels install.
# The host's local CA certificates (/usr/local/share/ca-certificates) go into the image: where
# outbound HTTPS passes through an inspecting proxy, pip inside the build trusts what the host
# trusts. Needs root and debootstrap (apt-get install debootstrap); takes about a minute.
set -euo pipefail

tag="${1:-splitspec-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$work/rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
if compgen -G "/usr/local/share/ca-certificates/*.crt" > /dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$work/rootfs/usr/local/share/ca-certificates/"
    chroot "$work/rootfs" update-ca-certificates > /dev/null
fi
# Downloaded packages and indexes: nothing in the image installs from apt.
rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
tar -C "$work/rootfs" --numeric-owner -c . \
    | docker import --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' - "$tag" > /dev/null
echo "$tag"
