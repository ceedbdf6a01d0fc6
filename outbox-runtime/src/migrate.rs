//! The embedded migrations and their runner.
//!
//! The SQL files in the crate's `migrations/` are in sqlx's format (`<version>_<description>.sql`), so an
//! application that manages its own migrations can copy them; `migrate` applies them itself and
//! records them in its own ledger table, `outbox_schema_migrations`, so it never collides with
//! the application's `_sqlx_migrations`.

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, Result};

/// One embedded migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Its version: the number its file name starts with. Migrations apply in its order.
    pub version: i64,
    /// Its description: the rest of its file name, without `.sql`.
    pub description: &'static str,
    /// Its SQL, one or more statements.
    pub sql: &'static str,
}

macro_rules! migration {
    ($version:literal, $description:literal) => {
        Migration {
            version: $version,
            description: $description,
            sql: include_str!(concat!(
                "../migrations/",
                stringify!($version),
                "_",
                $description,
                ".sql"
            )),
        }
    };
}

/// Every migration, in the order they apply.
pub const MIGRATIONS: &[Migration] = &[
    migration!(20261130000001, "outbox_event"),
    migration!(20261130000002, "inbox_event"),
    migration!(20261130000003, "processed_event"),
    migration!(20261130000004, "relay"),
    migration!(20261130000005, "inbox_processing"),
    migration!(20261130000006, "retention"),
    migration!(20261130000007, "relay_horizon"),
    migration!(20261201000008, "headers"),
    migration!(20261201000009, "inbox_source"),
    migration!(20261201000010, "schema_version"),
    migration!(20261202000011, "queue_autovacuum"),
    migration!(20261202000012, "consumer_missing_topic"),
    migration!(20261202000013, "processed_event_partitions"),
    migration!(20261202000014, "create_partitions_beside_another"),
    migration!(20261202000015, "inbox_event_partitions"),
    migration!(20261203000016, "outbox_event_partitions"),
    migration!(20261203000017, "partitioned_by_default"),
    migration!(20261203000018, "parked_rows_leave_the_retry_index"),
    migration!(20261203000019, "consumer_lease"),
    migration!(20261204000020, "operator_retries"),
    migration!(20261205000021, "inbox_order"),
    migration!(20261206000022, "inbox_shards"),
    migration!(20261206000023, "inbox_shard_pending"),
];

/// Key of the transaction-scoped advisory lock that serializes concurrent `migrate` calls.
const LOCK_KEY: i64 = 0x6f75_7462_6f78_6d67; // "outboxmg"

const LEDGER_SQL: &str = "\
CREATE TABLE IF NOT EXISTS outbox_schema_migrations (
    version     bigint      PRIMARY KEY,
    description text        NOT NULL,
    checksum    bigint      NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)";

impl Migration {
    /// FNV-1a of the SQL text: detects an applied migration that was edited afterwards.
    pub fn checksum(&self) -> i64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in self.sql.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        hash as i64
    }
}

/// Applies the pending migrations (idempotent).
///
/// Safe when several processes start at once: all of it runs in one transaction under an
/// advisory lock, so one process applies and the others then find nothing to do. A failing
/// migration leaves the schema as it was. Fails if an applied migration was edited.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    let mut conn = pool.acquire().await?;
    migrate_on(&mut conn).await
}

/// The embedded migrations not applied to the database yet (all of them on a fresh one).
/// Fails like [`migrate`] if an applied migration was edited.
pub async fn pending(pool: &PgPool) -> Result<Vec<Migration>> {
    let ledger: bool =
        sqlx::query_scalar("SELECT to_regclass('outbox_schema_migrations') IS NOT NULL")
            .fetch_one(pool)
            .await?;
    let applied: Vec<(i64, i64)> = if ledger {
        sqlx::query_as("SELECT version, checksum FROM outbox_schema_migrations")
            .fetch_all(pool)
            .await?
    } else {
        Vec::new()
    };
    unapplied(MIGRATIONS, &applied)
}

/// The migrations of `all` not among `applied` (their versions and checksums, from a ledger);
/// fails if an applied one was edited.
pub(crate) fn unapplied(all: &[Migration], applied: &[(i64, i64)]) -> Result<Vec<Migration>> {
    let mut pending = Vec::new();
    for m in all {
        match applied.iter().find(|(version, _)| *version == m.version) {
            Some(&(_, checksum)) if checksum != m.checksum() => {
                return Err(Error::MigrationChanged {
                    version: m.version,
                    description: m.description,
                    applied: checksum,
                    embedded: m.checksum(),
                })
            }
            Some(_) => {}
            None => pending.push(*m),
        }
    }
    Ok(pending)
}

/// [`migrate`] on a connection (not inside a transaction).
pub async fn migrate_on(conn: &mut PgConnection) -> Result<()> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(LEDGER_SQL).execute(&mut *tx).await?;
    let applied: Vec<(i64, i64)> =
        sqlx::query_as("SELECT version, checksum FROM outbox_schema_migrations")
            .fetch_all(&mut *tx)
            .await?;
    for m in unapplied(MIGRATIONS, &applied)? {
        let checksum = m.checksum();
        let fail = |source| Error::Migration {
            version: m.version,
            description: m.description,
            source,
        };
        sqlx::raw_sql(m.sql).execute(&mut *tx).await.map_err(fail)?;
        sqlx::query(
            "INSERT INTO outbox_schema_migrations (version, description, checksum) VALUES ($1, $2, $3)",
        )
        .bind(m.version)
        .bind(m.description)
        .bind(checksum)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
        tracing::info!(
            version = m.version,
            description = m.description,
            "applied outbox migration"
        );
    }
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::MIGRATIONS;

    /// `migrations/README.md` names, for each SQL function of the outbox and each of its
    /// arities, the last migration that defines it: the definition in force.
    #[test]
    fn the_migrations_readme_names_each_functions_current_definition() {
        let readme = include_str!("../migrations/README.md");
        let mut current: Vec<(String, usize, String)> = Vec::new();
        for m in MIGRATIONS {
            let file = format!("{}_{}.sql", m.version, m.description);
            let mut rest = m.sql;
            while let Some(at) = rest.find("FUNCTION ") {
                rest = &rest[at + "FUNCTION ".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let args = &rest[rest.find('(').unwrap() + 1..rest.find(')').unwrap()];
                let arity = args.split(',').filter(|a| !a.trim().is_empty()).count();
                current.retain(|(n, a, _)| !(*n == name && *a == arity));
                current.push((name, arity, file.clone()));
            }
        }
        assert!(!current.is_empty(), "the migrations define functions");
        for (name, arity, file) in current {
            let line = readme
                .lines()
                .find(|l| {
                    l.starts_with(&format!("| `{name}("))
                        && l.contains(&format!("{arity} argument"))
                })
                .unwrap_or_else(|| {
                    panic!("migrations/README.md has no line for {name} with {arity} arguments")
                });
            assert!(
                line.contains(&file),
                "migrations/README.md should name {file} as the definition of {name} with {arity} arguments: {line}"
            );
        }
    }
}
