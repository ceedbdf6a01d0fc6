//! `outbox inbox dead list | retry | discard`: inbox rows whose handlers failed for good.

use outbox_runtime::admin::{self, PoisonFilter};

use super::{
    chain, connect_migrated, filter_of, print_breakdown, print_list, require_selection, when,
    Result, DEFAULT_LIST_LIMIT,
};
use crate::args::{Act, DeadAction, InboxAction, List};
use crate::ui;

pub async fn run(action: InboxAction) -> Result {
    match action {
        InboxAction::Dead { action } => dead(action).await,
    }
}

async fn dead(action: DeadAction) -> Result {
    match action {
        DeadAction::List(List { db, select, json }) => {
            let pool = connect_migrated(&db, 2).await?;
            let filter = filter_of(&select, false, Some(DEFAULT_LIST_LIMIT))?;
            let rows = admin::list_dead(&pool, &filter).await.map_err(chain)?;
            print_list(
                &rows,
                json,
                select.limit,
                "no dead inbox rows",
                &[
                    ("EVENT_ID", false),
                    ("TOPIC", false),
                    ("EVENT_TYPE", false),
                    ("ATTEMPTS", true),
                    ("DEAD_AT", false),
                    ("LAST_ERROR", false),
                ],
                |r| {
                    vec![
                        r.event_id.to_string(),
                        r.topic.clone(),
                        r.event_type.clone(),
                        r.attempts.to_string(),
                        when(r.dead_at),
                        ui::short(r.last_error.as_deref().unwrap_or(""), 60),
                    ]
                },
            )
        }
        DeadAction::Retry(act) => act_on(act, true).await,
        DeadAction::Discard(act) => act_on(act, false).await,
    }
}

/// Retries (`retry`) or discards the dead rows `act` selects, once the user confirmed the
/// list.
async fn act_on(act: Act, retry: bool) -> Result {
    let Act {
        db,
        select,
        all,
        yes,
    } = act;
    require_selection(&select, all)?;
    let pool = connect_migrated(&db, 2).await?;
    let rows = admin::list_dead(&pool, &filter_of(&select, false, None)?)
        .await
        .map_err(chain)?;
    if rows.is_empty() {
        out!("no dead inbox rows match; nothing changed");
        return Ok(());
    }
    print_breakdown(
        rows.iter()
            .map(|r| (r.topic.as_str(), r.event_type.as_str())),
    );
    let n = rows.len();
    let question = if retry {
        format!("retry {n} dead inbox rows (their handlers run again)")
    } else {
        format!("discard {n} dead inbox rows (their handlers never run; a redelivery is not handled either)")
    };
    ui::confirm(&question, yes)?;
    // Exactly the rows listed to the user, even if more died meanwhile.
    let exact = rows
        .iter()
        .fold(PoisonFilter::all(), |f, r| f.event_id(r.event_id));
    if retry {
        let n = admin::retry_dead_by(&pool, &exact, "outbox inbox dead retry")
            .await
            .map_err(chain)?;
        out!("revived {n} dead inbox rows; running inbox processors handle them now");
    } else {
        let n = admin::discard_dead(&pool, &exact).await.map_err(chain)?;
        out!("discarded {n} dead inbox rows");
    }
    Ok(())
}
