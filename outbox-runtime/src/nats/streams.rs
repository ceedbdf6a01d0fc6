//! JetStream's streams as the relay and the consumers need them: the one that captures a
//! subject, created if told to, and the names the relay gives what it creates.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::context::GetStreamByNameErrorKind;

/// How to create a stream for a subject no stream captures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamSpec {
    pub(crate) replicas: usize,
    pub(crate) duplicate_window: Duration,
}

/// Why no stream was found for a subject.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// No stream captures it (and none was to be created).
    Missing,
    /// The server did not answer, or refused: what it said.
    Failed(String),
}

/// The name of the stream that captures `subject`; with `create`, one created for it if none
/// does (named by [`stream_name`], capturing the subject alone, file storage, limits
/// retention).
pub(crate) async fn stream_for(
    context: &jetstream::Context,
    subject: &str,
    create: Option<StreamSpec>,
) -> Result<String, Lookup> {
    let failed = |what: &str, e: &(dyn std::error::Error + 'static)| {
        Lookup::Failed(format!("{what}: {}", crate::error_chain(e)))
    };
    match context.stream_by_subject(subject).await {
        Ok(name) => Ok(name),
        Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {
            let Some(spec) = create else {
                return Err(Lookup::Missing);
            };
            let config = jetstream::stream::Config {
                name: stream_name(subject),
                subjects: vec![subject.to_owned()],
                num_replicas: spec.replicas,
                duplicate_window: spec.duplicate_window,
                ..Default::default()
            };
            context
                .create_stream(config)
                .await
                .map_err(|e| failed("cannot create the stream", &e))?;
            tracing::info!(
                subject,
                stream = stream_name(subject),
                "created a JetStream stream"
            );
            Ok(stream_name(subject))
        }
        Err(e) => Err(failed("cannot look the stream up", &e)),
    }
}

/// A stream's default duplicate window (the server's).
pub(crate) const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The name of the stream the relay creates for `topic`: what a stream name cannot hold
/// (`.`, `*`, `>`, path separators, white space) becomes `_`.
pub(crate) fn stream_name(topic: &str) -> String {
    topic
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' | '/' | '\\' => '_',
            c if c.is_whitespace() || c.is_control() => '_',
            c => c,
        })
        .collect()
}

/// The name of group `group`'s durable consumer of `topic`: `<group>_<topic>`, with what a
/// consumer name cannot hold (`.`, `*`, `>`, path separators, white space) as `_`.
pub(crate) fn durable_name(group: &str, topic: &str) -> String {
    stream_name(&format!("{group}_{topic}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_streams_are_named_after_their_topic() {
        assert_eq!(stream_name("order.events"), "order_events");
        assert_eq!(stream_name("a b/c"), "a_b_c");
    }

    #[test]
    fn durable_names_hold_no_dots_or_spaces() {
        assert_eq!(
            durable_name("orders", "payment.events"),
            "orders_payment_events"
        );
        assert_eq!(durable_name("my group", "a.*.>"), "my_group_a____");
    }
}
