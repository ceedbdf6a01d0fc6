//! The relay's Kafka producer: created with the settings the outbox's promises need, shared by
//! a relay's instances, replaced when it fails for good.

use std::sync::{Arc, RwLock};

use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, Producer};

use crate::error::{Error, Result};

/// Creates the idempotent producer the relay and replays publish with: `enable.idempotence`,
/// `acks=all`, `enable.gapless.guarantee` and no producer-side message timeout (settings that
/// say otherwise are refused); `linger.ms=0` unless set.
pub(crate) fn create_producer(mut producer: ClientConfig) -> Result<FutureProducer> {
    let config_err = |msg: String| Err(Error::Config(msg));
    let required: [(&[&str], &[&str], &str, &str); 4] = [
        (
            &["enable.idempotence"],
            &["true"],
            "true",
            "the outbox's producer (relay, replay) must be idempotent (R-DIST-IDEM-X2)",
        ),
        (
            &["acks", "request.required.acks"],
            &["all", "-1"],
            "all",
            "the outbox's producer (relay, replay) must wait for all in-sync replicas (use acks=all)",
        ),
        (
            &["enable.gapless.guarantee"],
            &["true"],
            "true",
            "the outbox's producer must fail rather than leave a gap in a key's events",
        ),
        (
            &["message.timeout.ms", "delivery.timeout.ms"],
            &["0"],
            "0",
            "the outbox's producer must not time messages out itself (a timed-out record can be \
             overtaken by a later one of its key); the relay bounds its waits with \
             publish_timeout",
        ),
    ];
    for (keys, allowed, default, why) in required {
        match keys
            .iter()
            .find_map(|k| producer.get(k).map(|v| (*k, v.to_owned())))
        {
            None => {
                producer.set(keys[0], default);
            }
            Some((_, value)) if allowed.contains(&value.as_str()) => {}
            Some((key, value)) => {
                return config_err(format!("{why}: {key}={value} is not allowed"));
            }
        }
    }
    if producer.get("linger.ms").is_none() {
        producer.set("linger.ms", "0");
    }
    // A topic the cluster does not know fails its records after this long (librdkafka's
    // default, 30 s, stalls every batch meanwhile). A topic created moments ago and taken for
    // missing costs nothing: its record is held and tried again.
    if producer.get("topic.metadata.propagation.max.ms").is_none() {
        producer.set("topic.metadata.propagation.max.ms", "1000");
    }
    producer.create().map_err(|source| Error::KafkaClient {
        client: "producer",
        source,
    })
}

/// The producer every instance of a relay shares, replaced when it fails for good.
pub(crate) struct ProducerSlot {
    config: ClientConfig,
    current: RwLock<Arc<FutureProducer>>,
}

impl ProducerSlot {
    pub(crate) fn new(config: ClientConfig) -> Result<ProducerSlot> {
        let producer = create_producer(config.clone())?;
        Ok(ProducerSlot {
            config,
            current: RwLock::new(Arc::new(producer)),
        })
    }

    pub(crate) fn get(&self) -> Arc<FutureProducer> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// If `used` (the producer a batch used) has a fatal error, replaces it with a new one,
    /// unless another instance did already. Its unacknowledged records were failed by the fatal
    /// error; the rows stay unpublished and are sent again on the new producer.
    pub(crate) fn recover(&self, used: &Arc<FutureProducer>) {
        let Some((code, reason)) = used.client().fatal_error() else {
            return;
        };
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if !Arc::ptr_eq(&current, used) {
            return;
        }
        match create_producer(self.config.clone()) {
            Ok(producer) => {
                tracing::error!(error = ?code, %reason,
                    "the outbox relay's Kafka producer failed for good; replaced it with a new one");
                metrics::counter!("outbox_relay_producer_recreated_total").increment(1);
                *current = Arc::new(producer);
            }
            Err(e) => tracing::error!(error = %crate::error_chain(&e), fatal = %reason,
                "the outbox relay's Kafka producer failed for good and cannot be replaced"),
        }
    }
}
