#!/usr/bin/env bash
# Usage: cargo build --release -p outbox-examples --example quickstart && bash tests/scripts/quickstart-databases.sh
# (N=500 orders per run by default; MariaDB as the user `outbox` that .ci/run creates.)
# The quickstart's --demo on PostgreSQL and on MariaDB, alternated, fresh databases each run.
set -u
bin=${BIN:-target/release/examples/quickstart}
n=${N:-500}
for i in 1 2 3; do
  for db in postgres mariadb; do
    name="outbox_qsbench_${db}_$i"
    if [ $db = postgres ]; then url="postgres://postgres@127.0.0.1:5432/$name"; else url="mysql://outbox:outbox@127.0.0.1:3306/$name"; fi
    out=$(DATABASE_URL=$url timeout 300 $bin --database $db --demo $n --listen 127.0.0.1:0 2>/dev/null | grep "^demo:")
    echo "$db run $i: $(echo "$out" | tr '\n' '|')"
    if [ $db = postgres ]; then psql -q -h 127.0.0.1 -U postgres -c "DROP DATABASE IF EXISTS $name WITH (FORCE)" -c "DROP DATABASE IF EXISTS ${name}_payments WITH (FORCE)" postgres; else mariadb -u root -e "DROP DATABASE IF EXISTS $name; DROP DATABASE IF EXISTS ${name}_payments"; fi
  done
done
