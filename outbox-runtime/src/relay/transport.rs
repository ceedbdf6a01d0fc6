//! The seam between the relay and a broker: what a batch asks of whichever transport the relay
//! was built with (send the rows, keeping each key's order; say which were stored; answer a
//! readiness probe). Kafka and JetStream are its two implementations, each behind its feature.

use std::time::Duration;

use super::publish::{self, Outcome};
use super::settings::Settings;
use super::store::Claimed;

/// The broker a relay publishes to.
pub(crate) enum Transport {
    /// Kafka, through the idempotent producer every instance shares.
    #[cfg(feature = "kafka")]
    Kafka(super::producer::ProducerSlot),
    /// NATS JetStream.
    #[cfg(feature = "nats")]
    JetStream(Box<super::jetstream::Publisher>),
}

impl Transport {
    /// Sends the rows and waits for their acknowledgements (at most the publish timeout): one
    /// outcome per row, in order. See [`publish::publish`] for how a key's order is kept.
    pub(crate) async fn publish(&self, rows: &[Claimed], settings: &Settings) -> Vec<Outcome> {
        let (timeout, cloud_events) = (settings.publish_timeout, settings.cloud_events.as_ref());
        match *self {
            #[cfg(feature = "kafka")]
            Transport::Kafka(ref slot) => {
                let producer = slot.get();
                let outcomes =
                    publish::publish(&*producer, rows, timeout, settings.per_key, cloud_events)
                        .await;
                slot.recover(&producer);
                outcomes
            }
            // JetStream numbers no producer's messages: a refused message does not take the
            // ones behind it with it, so a key's next one goes only once this one is stored.
            #[cfg(feature = "nats")]
            Transport::JetStream(ref publisher) => {
                let one = publish::PerKey::OneInFlight;
                publish::publish(&**publisher, rows, timeout, one, cloud_events).await
            }
        }
    }

    /// Whether the broker answers within `within`; `Err` says what failed.
    pub(crate) async fn ready(&self, within: Duration) -> Result<(), String> {
        match *self {
            #[cfg(feature = "kafka")]
            Transport::Kafka(ref slot) => {
                let producer = slot.get();
                let asked = tokio::task::spawn_blocking(move || {
                    use rdkafka::producer::Producer;
                    producer.client().fetch_metadata(None, within).map(|_| ())
                })
                .await;
                match asked {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(format!("the broker: {e}")),
                    Err(e) => Err(format!("the broker check failed: {e}")),
                }
            }
            #[cfg(feature = "nats")]
            Transport::JetStream(ref publisher) => publisher.ready(within).await,
        }
    }
}
