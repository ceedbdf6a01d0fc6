//! `outbox topics ensure`: the topics an installation needs, created where missing.

use outbox_runtime::admin::{EnsureTopics, TopicAction, TopicRole};

use super::{chain, connect_migrated, print_json, producer_config, Result};
use crate::args::{TopicsAction, TopicsEnsureArgs, Transport};
use crate::ui;

pub async fn run(action: TopicsAction) -> Result {
    match action {
        TopicsAction::Ensure(args) => ensure(args).await,
    }
}

async fn ensure(args: TopicsEnsureArgs) -> Result {
    if args.transport == Transport::Rabbitmq {
        return ensure_rabbitmq(args).await;
    }
    let brokers = args.kafka();
    let TopicsEnsureArgs {
        db,
        topics,
        partitions,
        replication_factor,
        retry_tiers,
        retry_suffix,
        dlq_suffix,
        dry_run,
        json,
        ..
    } = args;
    let config = producer_config(&brokers)?;
    let pool = connect_migrated(&db, 2).await?;
    let mut plan = topics
        .into_iter()
        .fold(EnsureTopics::new(), EnsureTopics::topic)
        .retry_tiers(retry_tiers)
        .retry_suffix(retry_suffix)
        .dlq_suffix(dlq_suffix)
        .dry_run(dry_run);
    if let Some(p) = partitions {
        plan = plan.partitions(p);
    }
    if let Some(r) = replication_factor {
        plan = plan.replication_factor(r);
    }
    let ensured = plan.run(&pool, &config).await.map_err(chain)?;
    if json {
        return print_json(&ensured);
    }
    if ensured.is_empty() {
        out!("no topics to ensure: name some with --topic (the outbox has no waiting rows)");
        return Ok(());
    }
    let rows: Vec<Vec<String>> = ensured
        .iter()
        .map(|t| {
            vec![
                t.topic.clone(),
                match t.role {
                    TopicRole::Source => "source",
                    TopicRole::Retry => "retry",
                    TopicRole::DeadLetter => "dead-letter",
                    _ => "other",
                }
                .to_owned(),
                t.partitions.to_string(),
                match t.action {
                    TopicAction::Exists => "exists",
                    TopicAction::Created => "created",
                    TopicAction::WouldCreate => "would create",
                    _ => "other",
                }
                .to_owned(),
            ]
        })
        .collect();
    ui::table(
        &["TOPIC", "ROLE", "PARTITIONS", "ACTION"],
        &[false, false, true, false],
        &rows,
    );
    let count = |a: TopicAction| ensured.iter().filter(|t| t.action == a).count();
    if dry_run {
        out!(
            "dry run: {} of {} topics would be created",
            count(TopicAction::WouldCreate),
            ensured.len()
        );
    } else {
        out!(
            "created {} of {} topics; the others exist",
            count(TopicAction::Created),
            ensured.len()
        );
    }
    Ok(())
}

/// `topics ensure --transport rabbitmq`: each topic's exchange and each group's queues,
/// declared (or, with --dry-run, looked up), and what each queue holds.
async fn ensure_rabbitmq(args: TopicsEnsureArgs) -> Result {
    let Some(settings) = args.rabbitmq.settings() else {
        return Err("--transport rabbitmq needs --rabbitmq URL (or RABBITMQ_URL)".into());
    };
    if args.groups.is_empty() {
        return Err(
            "--transport rabbitmq needs the consumer groups whose queues to declare: --group \
             GROUP (repeatable)"
                .into(),
        );
    }
    let pool = connect_migrated(&args.db, 2).await?;
    let mut topics = args.topics.clone();
    let waiting: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT topic FROM outbox_event \
         WHERE published_at IS NULL AND parked_at IS NULL ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .map_err(chain)?;
    for topic in waiting {
        if !topics.contains(&topic) {
            topics.push(topic);
        }
    }
    if topics.is_empty() {
        out!("no topics to ensure: name some with --topic (the outbox has no waiting rows)");
        return Ok(());
    }
    let mut rows = Vec::new();
    let mut report = Vec::new();
    for topic in &topics {
        for group in &args.groups {
            let queues = if args.dry_run {
                settings.topology(topic, group).await
            } else {
                settings.ensure_topology(topic, group).await
            }
            .map_err(chain)?;
            for (queue, depth) in queues {
                rows.push(vec![
                    topic.clone(),
                    group.clone(),
                    queue.clone(),
                    depth.map_or("-".into(), |d| d.messages.to_string()),
                    depth.map_or("-".into(), |d| d.consumers.to_string()),
                    match (depth, args.dry_run) {
                        (Some(_), _) => "exists",
                        (None, true) => "would create",
                        (None, false) => "missing",
                    }
                    .to_owned(),
                ]);
                report.push(serde_json::json!({
                    "topic": topic,
                    "group": group,
                    "queue": queue,
                    "messages": depth.map(|d| d.messages),
                    "consumers": depth.map(|d| d.consumers),
                }));
            }
        }
    }
    if args.json {
        return print_json(&report);
    }
    ui::table(
        &["TOPIC", "GROUP", "QUEUE", "MESSAGES", "CONSUMERS", "STATE"],
        &[false, false, false, true, true, false],
        &rows,
    );
    if args.dry_run {
        out!("dry run: nothing declared");
    } else {
        out!(
            "declared {} topic(s) for {} group(s) on {} ({} shards each)",
            topics.len(),
            args.groups.len(),
            settings.url_for_display(),
            args.rabbitmq.shards
        );
    }
    Ok(())
}
