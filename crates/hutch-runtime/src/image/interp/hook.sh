#!/bin/sh
# mmdebstrap customize hook of the code-interpreter image (run by hutch on
# the host, as root, once the Debian packages are in): $1 is the image's
# root, $2 hutch's work directory with `wheels/` (downloaded and checked by
# the host's pip), `requirements.lock` and `files/`. Commands inside the
# root run by chroot with a clean environment; nothing is fetched here.
set -eu
root="$1"
work="$2"
venv=/opt/hutch/python
server=/opt/hutch/interp

inside() {
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$root" "$@"
}

# The Python of the kernels, and of `python3`/`pip` in the sandbox (first
# on PATH): a virtual environment of the pinned wheels, offline.
inside /usr/bin/python3 -m venv "$venv"
mkdir "$root/tmp/hutch-wheels"
cp "$work"/wheels/*.whl "$work/requirements.lock" "$root/tmp/hutch-wheels/"
inside "$venv/bin/python" -m pip install --quiet --no-index --no-deps --require-hashes \
    --no-cache-dir --disable-pip-version-check --find-links /tmp/hutch-wheels \
    -r /tmp/hutch-wheels/requirements.lock
rm -rf "$root/tmp/hutch-wheels"

# The server and its kernel's settings.
mkdir -p "$root$server" "$root$venv/share/jupyter/kernels/hutch-python"
for f in server.py jsrunner.js startup.py kernel_config.py; do
    install -m 0644 "$work/files/$f" "$root$server/$f"
done
install -m 0644 "$work/files/kernel.json" "$root$venv/share/jupyter/kernels/hutch-python/kernel.json"
inside "$venv/bin/python" -m compileall -q "$server"

# The sandbox's user (1000) owns the environment, so `pip install` works
# in a sandbox as it does in E2B's (into the sandbox's own layer).
chown -R 1000:1000 "$root$venv"
