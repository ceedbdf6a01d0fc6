//! The command line: `--listen`, `--demo`, `--trace`, `--console`, `--transport`,
//! `--database`, `--help`.

use std::net::{Ipv4Addr, SocketAddr};

pub const USAGE: &str = "\
usage: cargo run --example quickstart -- [--listen ADDR] [--demo N] [--trace] [--console ADDR]
                                         [--transport kafka|nats|rabbitmq]
                                         [--database postgres|mariadb]

  --listen ADDR   serve the orders API on ADDR (default 127.0.0.1:3000; port 0: a free port)
  --demo N        post N orders to the API, wait until all are paid, print the time, stop
  --trace         print every span as it ends (stderr): each order's spans share a trace id
  --console ADDR  serve the operator console of both databases on ADDR (e.g. 127.0.0.1:3001):
                  read-only, or with actions if OUTBOX_CONSOLE_TOKEN is set
  --transport T   the broker between the services: kafka (default), nats (NATS JetStream at
                  NATS_URL; the streams are created) or rabbitmq (at RABBITMQ_URL; the
                  exchanges and queues are declared)
  --database D    the services' databases: postgres (default) or mariadb (MariaDB 10.6+ or
                  MySQL 8.0.1+; the orders consumer in dedup mode, and no --console: inbox
                  mode and the console are not built there yet)
  --help          this text

environment:
  DATABASE_URL    orders database (default postgres://postgres@127.0.0.1:5432/outbox_quickstart,
                  or with --database mariadb mysql://outbox:outbox@127.0.0.1:3306/outbox_quickstart);
                  the payments service uses the same name + `_payments`; both are created
  KAFKA_BROKERS   a Kafka to use (default: an embedded mock cluster)
  NATS_URL        with --transport nats: the nats-server (default nats://127.0.0.1:4222),
                  with JetStream enabled (`nats-server -js`)
  RABBITMQ_URL    with --transport rabbitmq: the server (default
                  amqp://guest:guest@127.0.0.1:5672)
  OUTBOX_CONSOLE_TOKEN  with --console: allows its actions to whoever signs in with it";

#[derive(Debug)]
pub struct Args {
    /// Where the orders API listens.
    pub listen: SocketAddr,
    /// `--demo N`: post N orders, wait until they are paid, stop.
    pub demo: Option<usize>,
    /// `--trace`: print every span as it ends.
    pub trace: bool,
    /// `--console ADDR`: serve the operator console there.
    pub console: Option<SocketAddr>,
    /// `--transport`: the broker between the services.
    pub transport: Transport,
    /// `--database`: the services' databases.
    pub database: Database,
}

/// The services' databases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Database {
    Postgres,
    MariaDb,
}

/// The broker between the services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Kafka,
    Nats,
    RabbitMq,
}

impl Args {
    /// The arguments, or `None` for `--help`.
    pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
        let mut parsed = Args {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 3000)),
            demo: None,
            trace: false,
            console: None,
            transport: Transport::Kafka,
            database: Database::Postgres,
        };
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) => (flag.to_owned(), Some(value.to_owned())),
                None => (arg.clone(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("`{flag}` needs a value"))
            };
            match flag.as_str() {
                "--listen" => {
                    let value = value()?;
                    parsed.listen = value.parse().map_err(|_| {
                        format!("`--listen {value}`: not an address such as 127.0.0.1:3000")
                    })?;
                }
                "--demo" => {
                    let value = value()?;
                    match value.parse::<usize>() {
                        Ok(n) if n > 0 => parsed.demo = Some(n),
                        _ => {
                            return Err(format!(
                                "`--demo {value}`: not a number of orders (1 or more)"
                            ))
                        }
                    }
                }
                "--trace" if inline.is_none() => parsed.trace = true,
                "--transport" => {
                    parsed.transport = match value()?.as_str() {
                        "kafka" => Transport::Kafka,
                        "nats" => Transport::Nats,
                        "rabbitmq" => Transport::RabbitMq,
                        other => {
                            return Err(format!("`--transport {other}`: kafka, nats or rabbitmq"));
                        }
                    };
                }
                "--database" => {
                    parsed.database = match value()?.as_str() {
                        "postgres" | "postgresql" => Database::Postgres,
                        "mariadb" | "mysql" => Database::MariaDb,
                        other => return Err(format!("`--database {other}`: postgres or mariadb")),
                    };
                }
                "--console" => {
                    let value = value()?;
                    parsed.console = Some(value.parse().map_err(|_| {
                        format!("`--console {value}`: not an address such as 127.0.0.1:3001")
                    })?);
                }
                "-h" | "--help" => return Ok(None),
                _ => return Err(format!("unknown argument `{arg}`")),
            }
        }
        if parsed.database == Database::MariaDb && parsed.console.is_some() {
            return Err(
                "`--console` is not built on MariaDB yet: leave it out with `--database \
                 mariadb` (`outbox status` and `outbox parked` take its mysql:// URL)"
                    .to_owned(),
            );
        }
        Ok(Some(parsed))
    }
}
