#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for tests: `source scripts/pg-scratch.sh`
# makes one in a new temporary directory (initdb as the `postgres` user),
# starts it on a unix socket in that directory only (no TCP port, so it
# cannot collide with another cluster), exports HUTCH_TEST_POSTGRES (the
# URL of its `postgres` database, whose superuser the store's tests use to
# make one database per test), and defines pg_scratch_stop, which stops
# the cluster and removes the directory (call it from an EXIT trap).
# Durability is off (fsync): nothing in it outlives the tests.
# Needs Debian's postgresql package (any version; the newest installed is
# used) and root (to run the server as `postgres`).

pg_scratch_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$pg_scratch_bin" ] || [ ! -x "$pg_scratch_bin/initdb" ]; then
    echo "pg-scratch: no PostgreSQL server (apt-get install postgresql)" >&2
    return 1 2>/dev/null || exit 1
fi
pg_scratch_dir=$(mktemp -d /tmp/hutch-pg.XXXXXX)
chown postgres: "$pg_scratch_dir"

pg_scratch_stop() {
    if [ -n "${pg_scratch_dir:-}" ] && [ -d "$pg_scratch_dir" ]; then
        runuser -u postgres -- "$pg_scratch_bin/pg_ctl" -D "$pg_scratch_dir/data" -m immediate -w stop \
            >/dev/null 2>&1 || true
        rm -rf "$pg_scratch_dir"
    fi
}

runuser -u postgres -- "$pg_scratch_bin/initdb" -D "$pg_scratch_dir/data" -U postgres -A trust \
    --no-sync -E UTF8 >"$pg_scratch_dir/initdb.log" 2>&1 \
    || { cat "$pg_scratch_dir/initdb.log" >&2; pg_scratch_stop; return 1 2>/dev/null || exit 1; }
runuser -u postgres -- "$pg_scratch_bin/pg_ctl" -D "$pg_scratch_dir/data" -l "$pg_scratch_dir/server.log" -w \
    -o "-k $pg_scratch_dir -c listen_addresses='' -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300" \
    start >/dev/null \
    || { cat "$pg_scratch_dir/server.log" >&2; pg_scratch_stop; return 1 2>/dev/null || exit 1; }
export HUTCH_TEST_POSTGRES="postgres://postgres@${pg_scratch_dir//\//%2F}/postgres"
