//! `outbox parked list | retry | drop`: outbox events the broker refused too often.

use outbox_runtime::admin::{self, ParkedEvent, PoisonFilter};

use super::{
    chain, filter_of, print_breakdown, print_list, require_selection, when, OutboxDb, Result,
    DEFAULT_LIST_LIMIT,
};
use crate::args::{List, ParkedAction};
use crate::ui;

/// The parked rows' operations on either database.
impl OutboxDb {
    async fn list(&self, filter: &PoisonFilter) -> Result<Vec<ParkedEvent>> {
        match self {
            OutboxDb::Postgres(pool) => admin::list_parked(pool, filter).await,
            OutboxDb::MySql(pool) => outbox_runtime::mysql::list_parked(pool, filter).await,
        }
        .map_err(chain)
    }

    async fn retry(&self, filter: &PoisonFilter, action: &str) -> Result<u64> {
        match self {
            OutboxDb::Postgres(pool) => admin::retry_parked_by(pool, filter, action).await,
            OutboxDb::MySql(pool) => {
                outbox_runtime::mysql::retry_parked_by(pool, filter, action).await
            }
        }
        .map_err(chain)
    }

    async fn drop(&self, filter: &PoisonFilter) -> Result<u64> {
        match self {
            OutboxDb::Postgres(pool) => admin::drop_parked(pool, filter).await,
            OutboxDb::MySql(pool) => outbox_runtime::mysql::drop_parked(pool, filter).await,
        }
        .map_err(chain)
    }
}

pub async fn run(action: ParkedAction) -> Result {
    let (act, retry) = match action {
        ParkedAction::List(List { db, select, json }) => {
            let outbox = OutboxDb::connect(&db).await?;
            let filter = filter_of(&select, true, Some(DEFAULT_LIST_LIMIT))?;
            let rows = outbox.list(&filter).await?;
            return print_list(
                &rows,
                json,
                select.limit,
                "no parked events",
                &[
                    ("ID", true),
                    ("EVENT_ID", false),
                    ("TOPIC", false),
                    ("KEY", false),
                    ("EVENT_TYPE", false),
                    ("ATTEMPTS", true),
                    ("PARKED_AT", false),
                    ("LAST_ERROR", false),
                ],
                |r| {
                    vec![
                        r.id.to_string(),
                        r.event_id.to_string(),
                        r.topic.clone(),
                        ui::short(&r.partition_key, 24),
                        r.event_type.clone(),
                        r.attempts.to_string(),
                        when(r.parked_at),
                        ui::short(r.last_error.as_deref().unwrap_or(""), 60),
                    ]
                },
            );
        }
        ParkedAction::Retry(act) => (act, true),
        ParkedAction::Drop(act) => (act, false),
    };
    require_selection(&act.select, act.all)?;
    let outbox = OutboxDb::connect(&act.db).await?;
    let rows = outbox.list(&filter_of(&act.select, true, None)?).await?;
    if rows.is_empty() {
        out!("no parked events match; nothing changed");
        return Ok(());
    }
    print_breakdown(
        rows.iter()
            .map(|r| (r.topic.as_str(), r.event_type.as_str())),
    );
    let n = rows.len();
    let question = if retry {
        format!("retry {n} parked events (the relay publishes them again, after their keys' later events)")
    } else {
        format!("delete {n} parked events for good (they will never be published)")
    };
    ui::confirm(&question, act.yes)?;
    // Exactly the rows listed to the user, even if more were parked meanwhile.
    let exact = rows.iter().fold(PoisonFilter::all(), |f, r| f.id(r.id));
    if retry {
        let n = outbox.retry(&exact, "outbox parked retry").await?;
        out!("un-parked {n} events; running relays publish them now");
    } else {
        let n = outbox.drop(&exact).await?;
        out!("dropped {n} parked events");
    }
    Ok(())
}
