//! What the relay, the consumers and the operator's tools ask a Kafka broker alike.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::client::{Client, ClientContext};
use rdkafka::error::KafkaResult;

/// The topics the broker has, with their partition counts, from the cluster's metadata (all
/// topics: asking for one by name would create it on a broker that auto-creates topics).
/// Blocks for up to `timeout`: call it from `spawn_blocking`.
pub(crate) fn existing_topics<C: ClientContext>(
    client: &Client<C>,
    timeout: Duration,
) -> KafkaResult<BTreeMap<String, i32>> {
    let metadata = client.fetch_metadata(None, timeout)?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .map(|t| (t.name().to_owned(), t.partitions().len() as i32))
        .collect())
}
