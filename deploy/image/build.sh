#!/usr/bin/env bash
# `make image`: builds kvgate's image with buildah (vfs storage, chroot
# isolation: no daemon, no base image to pull), then verifies it by
# exporting its root filesystem and running the entrypoint in a chroot:
# `--version`, and `serve --demo` answering a gRPC client (kvgate tail).
#
# The image holds the release binary of `make release` (optimized with a
# profile of its hot path, deploy/pgo/build.sh) without debug info; its
# symbols are written to target/pgo/kvgate.debug (linked by
# .gnu_debuglink) for profiling.
set -euo pipefail
cd "$(dirname "$0")/../.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
image=${IMAGE:-kvgate:$version}
buildah=(buildah --storage-driver vfs)

# Installing packages is the user's call, not a build script's.
command -v buildah >/dev/null || {
	echo "make image needs buildah, which is not installed." >&2
	echo "On Debian or Ubuntu: sudo apt-get install --no-install-recommends buildah" >&2
	exit 1
}

deploy/pgo/build.sh
binary=target/pgo/kvgate

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
rootfs=$context/rootfs
mkdir -p "$rootfs/usr/local/bin" "$rootfs/etc" "$rootfs/tmp"
chmod 1777 "$rootfs/tmp"
objcopy --only-keep-debug "$binary" target/pgo/kvgate.debug
objcopy --strip-debug --add-gnu-debuglink=target/pgo/kvgate.debug \
	"$binary" "$rootfs/usr/local/bin/kvgate"
# The libraries the binary links, and the dynamic loader.
for lib in $(ldd "$binary" | grep -o '/[^ ]*'); do
	mkdir -p "$rootfs$(dirname "$lib")"
	cp -L "$lib" "$rootfs$lib"
done
echo 'nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin' >"$rootfs/etc/passwd"
echo 'nonroot:x:65532:' >"$rootfs/etc/group"
cp deploy/image/Containerfile "$context/Containerfile"

"${buildah[@]}" bud --isolation chroot --layers=false -f "$context/Containerfile" -t "$image" "$context"
"${buildah[@]}" images "$image"

# Verify: export the root filesystem, run the entrypoint in a chroot as the
# image's user.
container=$("${buildah[@]}" from "$image")
export_dir=$(mktemp -d)
cleanup() {
	[[ -n ${serve_pid:-} ]] && kill "$serve_pid" 2>/dev/null || true
	"${buildah[@]}" rm "$container" >/dev/null 2>&1 || true
	rm -rf "$export_dir" "$context"
}
trap cleanup EXIT
mounted=$("${buildah[@]}" mount "$container")
cp -a "$mounted/." "$export_dir/"
"${buildah[@]}" umount "$container" >/dev/null
entrypoint=$("${buildah[@]}" inspect --format '{{.OCIv1.Config.Entrypoint}}' "$image")
user=$("${buildah[@]}" inspect --format '{{.OCIv1.Config.User}}' "$image")
echo "image $image: entrypoint $entrypoint, user $user, $(du -sh "$export_dir" | cut -f1) unpacked"

chroot --userspec=65532:65532 "$export_dir" /usr/local/bin/kvgate --version

log=$(mktemp)
chroot --userspec=65532:65532 "$export_dir" /usr/local/bin/kvgate \
	serve --demo --listen 127.0.0.1:0 >"$log" 2>&1 &
serve_pid=$!
address=
for _ in $(seq 100); do
	address=$(sed -n 's/^kvgate: serving gRPC on \([^,]*\),.*/\1/p' "$log")
	[[ -n $address ]] && break
	sleep 0.1
done
[[ -n $address ]] || { cat "$log"; echo "kvgate in the image did not start" >&2; exit 1; }
"$binary" tail --addr "$address" --limit 2
kill "$serve_pid"
wait "$serve_pid" || true
serve_pid=
echo "verified: $image runs --version and serves the demo stream from a chroot of its root filesystem"
