//! A handler declared by a `macro_rules!` that takes its types as `ty` fragments (a suite
//! written once for each database): the fragment reaches the attribute wrapped in an invisible
//! group, and is read through it.
use outbox_runtime::inbox::{Handler, HandlerError, MessageMeta};
use outbox_runtime::OutboxEvent;

#[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
#[outbox(topic = "order.events", aggregate_type = "Order")]
pub struct OrderCreated {
    #[outbox(aggregate_id)]
    pub order_id: u64,
}

macro_rules! handlers {
    ($name:ident, $event:ty, $conn:ty, $meta:ty, $result:ty) => {
        mod $name {
            use super::*;

            #[outbox_runtime::inbox_handler]
            pub async fn ship(event: $event, tx: &mut $conn) -> $result {
                let _ = (event, tx);
                Ok(())
            }

            #[outbox_runtime::inbox_handler]
            pub async fn ship_with_meta(event: $event, tx: &mut $conn, meta: &$meta) -> $result {
                let _ = (event, tx, meta);
                Ok(())
            }
        }
    };
}

handlers!(
    postgres,
    OrderCreated,
    sqlx::PgConnection,
    MessageMeta,
    Result<(), HandlerError>
);
handlers!(
    mysql,
    OrderCreated,
    sqlx::MySqlConnection,
    MessageMeta<'_>,
    Result<(), HandlerError>
);

fn register<S, D: sqlx::Database, H: Handler<S, D>>(_handler: H) {}

fn main() {
    register::<(), sqlx::Postgres, _>(postgres::ship);
    register::<(), sqlx::Postgres, _>(postgres::ship_with_meta);
    register::<(), sqlx::MySql, _>(mysql::ship);
    register::<(), sqlx::MySql, _>(mysql::ship_with_meta);
}
