//! Consumers: deduplicated, transactional event handling with retries and dead letters
//! (rule R-DIST-OBX-2: delivery is at-least-once, so every receiver must be idempotent).
//!
//! ```no_run
//! use outbox_runtime::inbox::{Consumer, HandlerError, Mode};
//! use outbox_runtime::OutboxEvent;
//! use tokio_util::sync::CancellationToken;
//! use uuid::Uuid;
//!
//! #[derive(serde::Deserialize, serde::Serialize, OutboxEvent)]
//! #[outbox(topic = "payment.events", aggregate_type = "Payment", event_type = "PaymentSucceeded")]
//! struct PaymentSucceeded { #[outbox(aggregate_id)] payment_id: Uuid, order_id: Uuid, amount: i64 }
//!
//! #[outbox_runtime::inbox_handler]
//! async fn mark_order_paid(event: PaymentSucceeded, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
//!     sqlx::query("UPDATE orders SET payment_status = 'paid' WHERE id = $1")
//!         .bind(event.order_id).execute(tx).await?;
//!     Ok(())
//! }
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let consumer = Consumer::builder(pool.clone())
//!     .brokers("127.0.0.1:9092")
//!     .group_id("orders-service")
//!     .handler(mark_order_paid)    // several handlers; routed by topic + event_type header
//!     .mode(Mode::Dedup)           // default; Mode::Inbox for critical / bursty flows
//!     .build()?;
//! let cancel = CancellationToken::new();
//! let handle = consumer.spawn(cancel.clone());   // a tokio task; or `consumer.run(cancel).await`
//! # cancel.cancel(); handle.await??; Ok(()) }
//! ```
//!
//! `#[inbox_handler]` checks the signature at compile time (an `async fn`; one event parameter
//! whose type derives `OutboxEvent` and `Deserialize`; `&mut sqlx::PgConnection` (or, feature
//! `mysql`, `&mut sqlx::MySqlConnection`: a handler of consumers on a `MySqlPool`, see
//! `outbox_runtime::mysql`); then optionally
//! `state: &T` and `meta: &MessageMeta`, in either order; returning `Result<(), HandlerError>`;
//! each mistake is an error at the parameter) and turns the function into a unit struct of the
//! same name that implements [`Handler`] (its docs and visibility kept;
//! `mark_order_paid::call(event, tx)` runs the body). A handler that carries configuration can
//! implement [`Handler`] by hand: see its docs.
//!
//! On `cancel` the consumer finishes the messages (or inbox batch) in hand, commits the offsets of
//! what the database committed, and returns.
//!
//! # Modes
//!
//! **Dedup** (default): messages are handled in batches, in one transaction: for each message
//! and handler, `(event_id, "<group>/<handler>")` is inserted into `processed_event`
//! (`ON CONFLICT DO NOTHING`); only if the row is new does the handler run, in the same
//! transaction; then it commits (savepoints only after a handler failed); only then are the
//! offsets stored (`enable.auto.offset.store=false`) and later committed. A duplicate is skipped.
//! The handler's effect happens exactly once per event id. If a handler fails, the work since the
//! last savepoint is undone and done again: what came before the failing message, that message
//! alone (a savepoint per handler), then the rest; so only the failing message fails, and the
//! batch still commits once.
//!
//! **Inbox**: the consumer only stores each message in `inbox_event`
//! (`ON CONFLICT (event_id) DO NOTHING`, batched), commits, then stores the offsets, so receipt
//! keeps up with a burst. Processor tasks ([`processors`](ConsumerBuilder::processors), default 1;
//! 0 with [`Consumer::run_processor`] elsewhere) claim unprocessed rows in batches and run each
//! row's handlers and `processed = true` in one transaction (again with a savepoint per row if
//! one fails, so a failing row undoes only its own work). Failures record `attempts`,
//! `last_error` and `next_attempt_at` on the row; after `max_attempts` (or a permanent failure)
//! the row is dead (`dead_at`), kept for operators. **Inbox processing keeps each key's order**,
//! across every processor and instance: a key's rows are handled in the order they were
//! received (the broker's), by one processor at a time (each holds a share of 64 shards of the
//! keys through a server connection of its own, outside the pool, moved toward the fair share
//! between its batches; others take other keys meanwhile). A row waiting for its retry holds
//! back the later rows of its key, and nothing else; a dead row holds back nothing (as a dead
//! letter in dedup mode). Rows without a key are in no order. The processors are woken as soon as
//! a receipt commits new rows, and poll every [`poll_interval`](ConsumerBuilder::poll_interval)
//! for what other instances received and for retries coming due. A processor that stops on its
//! own (it should not) is logged, counted and restarted. Inbox mode deduplicates by `event_id` alone: give each service its own database or
//! schema.
//!
//! # Settings
//!
//! Set on [`ConsumerBuilder`]; [`build`](ConsumerBuilder::build) checks them and says which one
//! cannot work.
//!
//! | setting | default | |
//! |---|---|---|
//! | [`brokers`](ConsumerBuilder::brokers), [`group_id`](ConsumerBuilder::group_id) | required | |
//! | [`consumer_config`](ConsumerBuilder::consumer_config) | | librdkafka's settings; offsets are always stored by the consumer (`enable.auto.offset.store=false`); `auto.offset.reset=earliest` unless set |
//! | [`producer_config`](ConsumerBuilder::producer_config) | the consumer's servers and security settings | the retry and dead-letter producer (always idempotent, `acks=all`) |
//! | [`state`](ConsumerBuilder::state) | `()` | the application state handlers take (below) |
//! | [`handler`](ConsumerBuilder::handler), [`upcast`](ConsumerBuilder::upcast) | | handlers, and upcasters of older schema versions (below) |
//! | [`mode`](ConsumerBuilder::mode) | [`Mode::Dedup`] | or [`Mode::Inbox`] |
//! | [`max_attempts`](ConsumerBuilder::max_attempts) | 5 | attempts at a message before it is dead-lettered |
//! | [`retry_backoff`](ConsumerBuilder::retry_backoff) | 200 ms, doubling up to 30 s | between attempts; jittered after an outage |
//! | [`retry_policy`](ConsumerBuilder::retry_policy) | [`RetryPolicy::Topic`] | dedup mode only |
//! | [`retry_suffix`](ConsumerBuilder::retry_suffix), [`retry_tiers`](ConsumerBuilder::retry_tiers) | `.retry`, 1 | the retry topics |
//! | [`dlq_suffix`](ConsumerBuilder::dlq_suffix) | `.dlq` | the dead-letter topic |
//! | [`processors`](ConsumerBuilder::processors), [`batch_size`](ConsumerBuilder::batch_size), [`poll_interval`](ConsumerBuilder::poll_interval) | 1, 500, 200 ms | inbox mode's processors |
//!
//! # Failures, retries and dead letters
//!
//! [`HandlerError::Retryable`] is retried with backoff up to `max_attempts`; then, or at once for
//! [`HandlerError::Permanent`], the message is dead-lettered: to `<topic>.dlq` with its key, value
//! and headers and the reason in `dlq_error` (plus `dlq_attempts` and
//! `dlq_source_topic`/`dlq_source_partition`/`dlq_source_offset`, where the original was read,
//! also for a message dead-lettered from a retry topic), or, in inbox mode, as a dead
//! row (`dead_at`, `last_error`). What `?` makes of a database error or of this crate's
//! [`Error`](crate::Error): see [`HandlerError`].
//!
//! **Bad input**: a message that is not JSON, has no valid `event_id` header, does not
//! deserialize into the handler's event type, or (inbox mode) that `jsonb` refuses (a lone
//! surrogate escape, a number beyond `numeric`) is dead-lettered at once; its offset is stored
//! and consumption goes on. A message no handler is registered for is skipped.
//!
//! **The database down** is not the message's fault: the consumer waits and retries without
//! counting attempts or dead-lettering anything.
//!
//! **[`RetryPolicy::Topic`]** (dedup mode, the default, the style guide's R-DIST-OBX-2): a
//! retryable failure sends the message to `<topic>.retry` with its key, value and headers plus
//! `outbox_retry_attempts`, `outbox_retry_due_ms` (when it may run again), `outbox_retry_error`
//! and where the original was read (`outbox_retry_source_topic`, `_partition` and `_offset`,
//! carried from copy to copy), and stores its offset: its partition
//! flows on. The consumer also reads the retry topic and handles each message once it is due (a
//! not-yet-due message pauses its retry partition, nothing else). So **a retried message is
//! handled after its key's later messages**. [`retry_tiers(n)`](ConsumerBuilder::retry_tiers)
//! spreads attempts over `<topic>.retry-1` ... `-n`, so that a long backoff does not hold up short
//! ones. Create the retry and dead-letter topics with the source topic
//! ([`EnsureTopics`](crate::admin::EnsureTopics), `outbox topics ensure`); the consumer reads the
//! retry topic from the start (keep `auto.offset.reset=earliest`).
//! [`RetryPolicy::InPlace`] retries in the consumer instead, before anything after the message:
//! strict per-key order, but a failing message holds up every partition of that consumer
//! meanwhile. Inbox mode retries through its table and ignores the policy.
//!
//! **A retry or dead-letter topic that is missing** (or refuses) stops consumption, visibly: an
//! error log naming the topic, the gauge `outbox_consumer_forward_blocked{topic}` at 1. The
//! consumer pauses its partitions and keeps polling, so it keeps its group membership, and goes on
//! (gauge 0) once the topic takes the message, with every partition it paused, including those a
//! rebalance took away and gave back meanwhile. Nothing is skipped. So that this is no surprise,
//! a consumer checks its retry and dead-letter topics when it starts: a missing one is a warning
//! in its log, the gauge `outbox_consumer_missing_topic{topic}` at 1, and a row of
//! `outbox_consumer_missing_topic` that `outbox status` reports (a
//! [`MissingTopic`](crate::admin::Warning::MissingTopic) warning); it looks again every minute
//! until the topic exists.
//!
//! **Retries and dead letters are sent at least once**: a rebalance between the send and the
//! offset's commit sends the message again. A retried copy is deduplicated when it is handled; a
//! dead-letter reader should key on the `event_id` header.
//!
//! # What handlers must know
//!
//! - **A handler that catches a database error must use a savepoint or `ON CONFLICT`; if it
//!   does not, the framework treats the message as failed.** A failed statement aborts the
//!   transaction, and PostgreSQL answers `COMMIT` of an aborted transaction with a silent
//!   rollback: a handler that caught the error and returned `Ok` would "succeed" with its work
//!   gone. The framework checks the transaction after each handler (releasing its savepoint) and
//!   at commit; a handler that left it aborted fails its message only (retried, then
//!   dead-lettered), with an error that says so; the rest of the batch commits. Do this instead:
//!
//!   ```no_run
//!   use sqlx::Connection;
//!
//!   async fn record(tx: &mut sqlx::PgConnection, entry: i64) -> Result<(), sqlx::Error> {
//!       let mut sp = tx.begin().await?;               // a savepoint
//!       match sqlx::query("INSERT INTO ledger (entry) VALUES ($1)").bind(entry).execute(&mut *sp).await {
//!           Ok(_) => sp.commit().await?,              // RELEASE SAVEPOINT
//!           Err(e) if e.as_database_error().is_some_and(|d| d.is_unique_violation()) => {
//!               sp.rollback().await?                  // already recorded
//!           }
//!           Err(e) => return Err(e),
//!       }
//!       Ok(())                                        // or: INSERT ... ON CONFLICT DO NOTHING
//!   }
//!   ```
//! - Work refused at commit (a deferred constraint) fails its message: for good if it is an
//!   integrity violation. A deadlock or serialization failure is retried.
//! - **A panic** (in the handler, its future or its event's `Deserialize`) is caught and is a
//!   failure like any other: retried with the panic's message, then dead-lettered. The consumer
//!   and the processors keep running.
//! - **A handler can run more than once for one delivery** (when a batch-mate fails, the batch is
//!   redone): its database work commits once; whatever it does outside the transaction (an HTTP
//!   call) must be idempotent, as at-least-once delivery requires anyway.
//! - **Dedup keys** are `<consumer group>/<handler name>` (the name defaults to the function's),
//!   so services (groups) sharing a database never skip each other's work;
//!   `#[inbox_handler(name = "...")]` makes the key that name exactly, whatever the group: a
//!   choice that survives renaming the function or the group. Handler names are per instance
//!   ([`Handler::name`]), and `build` refuses one name twice for one event. To rename a handler
//!   (or change its group) without handling the retained events again, carry its keys over while
//!   no consumer of the group runs:
//!   `UPDATE processed_event SET handler = 'orders/new_name' WHERE handler = 'orders/old_name'`.
//!   Upgrading from a version that keyed rows by the bare name:
//!   `UPDATE processed_event SET handler = 'orders/' || handler WHERE handler NOT LIKE '%/%'`
//!   (with your group).
//!
//! # Application state and message metadata
//!
//! A handler that needs the application (an HTTP client, configuration, a cache) takes the
//! consumer's state; one that needs to know about the message takes its metadata:
//!
//! ```no_run
//! use outbox_runtime::inbox::{Consumer, HandlerError, MessageMeta};
//! use outbox_runtime::OutboxEvent;
//!
//! #[derive(serde::Deserialize, serde::Serialize, OutboxEvent)]
//! #[outbox(topic = "order.events", aggregate_type = "Order", event_type = "OrderCreated")]
//! struct OrderCreated { #[outbox(aggregate_id)] order_id: uuid::Uuid, amount: i64 }
//!
//! /// The application state: built once, shared by every handler call (behind an `Arc`).
//! struct Payments { provider: String }
//!
//! #[outbox_runtime::inbox_handler]
//! async fn charge(
//!     event: OrderCreated,
//!     tx: &mut sqlx::PgConnection,
//!     payments: &Payments,                       // the consumer's state
//!     meta: &MessageMeta,                        // the message's metadata
//! ) -> Result<(), HandlerError> {
//!     sqlx::query("INSERT INTO charges (order_id, provider, attempt, tenant) VALUES ($1, $2, $3, $4)")
//!         .bind(event.order_id)
//!         .bind(&payments.provider)
//!         .bind(meta.attempt() as i32)           // 1, then 2 after a failure, ...
//!         .bind(meta.header("tenant"))           // a header given to `emit_with`
//!         .execute(tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! fn consumer(pool: sqlx::PgPool) -> outbox_runtime::Result<Consumer> {
//!     Consumer::builder(pool)
//!         .brokers("127.0.0.1:9092")
//!         .group_id("payments")
//!         .state(Payments { provider: "acme-pay".into() })  // before the handlers that take it
//!         .handler(charge)
//!         .build()
//! }
//! ```
//!
//! **State** is typed: [`state(T)`](ConsumerBuilder::state) makes a `ConsumerBuilder<T>`, whose
//! `handler` takes handlers of `T` only. Registering `charge` on a consumer without `Payments`
//! state is a compile error (``charge` is not an inbox handler for state `()``), never a runtime
//! downcast. Handlers without a state parameter work with any state. One state per consumer: for
//! several parts, a struct of them; for what changes, a lock or `Arc`s inside.
//!
//! **[`MessageMeta`]** borrows from the message: the event's id and type, where it was read
//! (topic, partition, offset), its key, the application's headers (and a CloudEvent's `ce_*`
//! attributes), which attempt this is, its schema version and its trace context; its methods say
//! what each is for a retried message or an inbox row. A test builds one with
//! [`MessageMeta::new`] (see the `testing` module's `deliver_with`).
//!
//! The quickstart's payments service (`examples/quickstart/main.rs`) holds its payment-provider
//! client in its state, calls it with the event id as the idempotency key, and records the
//! attempt from the metadata.
//!
//! # CloudEvents
//!
//! A consumer also takes records that other producers wrote as
//! [CloudEvents](https://cloudevents.io) (Kafka protocol binding, binary content mode; this
//! crate's relay writes them with [`relay::CloudEvents`](crate::relay::CloudEvents)). A message
//! without `event_id`/`event_type` headers is read as a CloudEvent: the type from `ce_type`
//! (route it with `#[outbox(event_type = "com.example.x")]` on the struct), the id from `ce_id`:
//! a UUID in its canonical form (lowercase, hyphenated, as this crate's relay writes it) as it is;
//! any other id (another spelling of a UUID too, since CloudEvents compares ids as strings) mapped
//! to a UUIDv5 of `ce_source` and `ce_id` (CloudEvents ids are unique per source), so a redelivery
//! is still deduplicated. One without `ce_specversion` 1.x, `ce_source`, `ce_type` or a non-empty
//! `ce_id` is a dead letter that says which. The handler reads the attributes from its metadata,
//! e.g. `meta.header("ce_source")`, `meta.header("ce_id")` (the id as sent); inbox rows keep them
//! with the headers. Tested both ways against the specification's required attributes and naming
//! rules (`tests/tests/cloud_events.rs` in the repository).
//!
//! # Schema versions
//!
//! An event's payload changes. `#[outbox(version = 2)]` says which version a struct is (1 if
//! unsaid); consumers deployed before and after the change then agree on what each message is:
//!
//! ```no_run
//! use outbox_runtime::inbox::{BoxError, Consumer, HandlerError, MessageMeta};
//! use outbox_runtime::OutboxEvent;
//!
//! /// Version 1 had one `name`; version 2 splits it.
//! #[derive(serde::Deserialize, serde::Serialize, OutboxEvent)]
//! #[outbox(topic = "customer.events", aggregate_type = "Customer", version = 2)]
//! struct CustomerRenamed { #[outbox(aggregate_id)] customer_id: uuid::Uuid, first: String, last: String }
//!
//! #[outbox_runtime::inbox_handler]                // takes version 2 (its event's) only
//! async fn rename(event: CustomerRenamed, tx: &mut sqlx::PgConnection, meta: &MessageMeta)
//!     -> Result<(), HandlerError> {
//!     sqlx::query("UPDATE customers SET first = $2, last = $3, sent_as = $4 WHERE id = $1")
//!         .bind(event.customer_id)
//!         .bind(&event.first)
//!         .bind(&event.last)
//!         .bind(meta.schema_version() as i32)    // as sent: 1 if it was upcast
//!         .execute(tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! /// Version 1's payload, as JSON, made into version 2.
//! fn from_v1(v1: serde_json::Value) -> Result<CustomerRenamed, BoxError> {
//!     let name = v1["name"].as_str().ok_or("version 1 without `name`")?;
//!     let (first, last) = name.split_once(' ').unwrap_or((name, ""));
//!     Ok(CustomerRenamed {
//!         customer_id: serde_json::from_value(v1["customer_id"].clone())?,
//!         first: first.into(),
//!         last: last.into(),
//!     })
//! }
//!
//! fn consumer(pool: sqlx::PgPool) -> outbox_runtime::Result<Consumer> {
//!     Consumer::builder(pool)
//!         .brokers("127.0.0.1:9092")
//!         .group_id("crm")
//!         .handler(rename)
//!         .upcast::<CustomerRenamed, _>(1, from_v1)   // one upcaster per older version
//!         .build()
//! }
//! ```
//!
//! - **On the wire**: an event of version 2 or more carries the header `outbox_schema_version`
//!   ([`SCHEMA_VERSION_HEADER`](crate::SCHEMA_VERSION_HEADER); stored with the row's headers, so
//!   `outbox replay` sends it again); version 1 sends none, and a message without it is version 1.
//!   Messages from other producers are version 1 unless they set the header.
//! - **Which handler takes what**: a handler takes its event's own version as it is, and the
//!   versions it declares with `#[inbox_handler(versions = [1, 2])]` (a struct that reads both,
//!   with serde defaults for the new fields; the list must include the event's own version, a
//!   compile-time check). Hand-written handlers override [`Handler::accepts_version`]. For any
//!   other version, the consumer's upcaster from that version to the handler's event type makes
//!   the event from the payload's JSON.
//! - **Otherwise it is a dead letter**, with the reason (`dlq_error`: ``schema version 3 of
//!   `CustomerRenamed` is not accepted by handler `rename` (its event ... is version 2): no
//!   upcaster from version 3 is registered``); in inbox mode the row is marked dead with that
//!   error. An upcaster's error is permanent too. Deploy consumers before producers, or register
//!   the upcaster first, and nothing is dead-lettered. A header that is not a positive integer is
//!   a dead letter at once.
//! - Inbox rows keep the version (`inbox_event.schema_version`, migration 10);
//!   [`MessageMeta::schema_version`] is the version as sent, also for an upcast event.
//! - [`upcast`](ConsumerBuilder::upcast) lists what `build` refuses. Bad `version` values in the
//!   derive or the handler attribute are compile errors.
//!
//! # NATS JetStream
//!
//! With the `nats` feature, [`jetstream`](ConsumerBuilder::jetstream) reads from JetStream
//! instead of Kafka (a build with only `nats` has consumers and no librdkafka). The handlers,
//! state, metadata, modes, upcasters, dedup keys and CloudEvents (the relay's `ce-*` headers,
//! read as `ce_*`) are the same; what differs is the broker's half:
//!
//! - **A durable pull consumer per topic**, named `<group>_<topic>` (what a consumer name cannot
//!   hold, `.` `*` `>` white space and path separators, as `_`), filtering the topic's subject,
//!   explicit acknowledgement, `max_ack_pending` four [`batch_size`](ConsumerBuilder::batch_size)s.
//!   It is created at start, or its settings updated. A stream must capture the subject (or the
//!   consumer creates one: [`JetStream::create_streams`](crate::relay::JetStream::create_streams));
//!   while none does, the consumer waits and says so (a warning, the gauge
//!   `outbox_consumer_missing_topic{topic}` at 1).
//! - **Acknowledged after the commit**: a message is acknowledged once the transaction of its
//!   handlers (or its inbox row) committed. One the server delivers again (a crash, an
//!   acknowledgement lost with the server) is a duplicate, skipped as on Kafka. The server
//!   delivers again in the order its waits ran out, not the stream's (a message delivered
//!   again and left once more comes behind the others), so a reader that starts with messages
//!   delivered before takes them all and handles them in the stream's order. While a batch
//!   takes long (a slow handler, the database out), the consumer tells the server it is still at
//!   it every third of [`ack_wait`](crate::relay::JetStream::ack_wait) (30 s by default).
//! - **Retries are the server's redeliveries**: a retryable failure is refused (`nak`) with the
//!   backoff as its delay; the server delivers it again then, and nothing else waits for it (the
//!   retry topic's behaviour, without a retry topic: [`retry_suffix`](ConsumerBuilder::retry_suffix)
//!   and [`retry_tiers`](ConsumerBuilder::retry_tiers) do not apply).
//!   [`MessageMeta::attempt`] is the server's delivery count, so a delivery a crash interrupted
//!   counts as an attempt. [`RetryPolicy::InPlace`] retries in the consumer, as on Kafka.
//! - **Dead letters** go to `<topic>.dlq` (a stream must capture it, or `create_streams`), with
//!   the payload and headers and the Kafka dead letters' fields: `dlq_error`, `dlq_attempts`,
//!   `dlq_source_topic`, `dlq_source_partition` (0: a stream is one ordered log),
//!   `dlq_source_offset` (the stream sequence), and `dlq_source_stream`. The original is
//!   terminated only once a stream stored its dead letter (`Nats-Msg-Id`
//!   `dlq:<stream>:<sequence>:<when it was stored>`, so one sent again after a crash is stored
//!   once). While no stream
//!   takes it, the topic's reading waits, with an error in the log and the gauge
//!   `outbox_consumer_forward_blocked{topic}` at 1.
//! - **Per-key order** (dedup mode): JetStream hands a durable consumer's messages to whichever
//!   instance pulls, and has no partitions to assign, so one instance of a group reads a topic at
//!   a time, under a lease in the consumer's database (`outbox_consumer_lease`, as long as
//!   `ack_wait`, renewed every third of it). Every batch transaction checks the lease first
//!   (`FOR KEY SHARE`; on MariaDB/MySQL a fence row of its own read with a shared lock, see
//!   the `mysql` module): an instance that lost it commits nothing more. The others stand by and take it over once it is released
//!   (a consumer that stops) or expired (a crash). An instance that starts reading while
//!   messages delivered before are not settled (what a crashed instance held, what a stopped
//!   one had fetched beyond its last batch, retries waiting) first waits `ack_wait`, so that
//!   they come again before anything newer (the server serves redeliveries first).
//!   So a key's messages are handled in order, except a retried one (after its key's later
//!   messages, as with Kafka's retry topic). Throughput per topic is one instance's; topics are
//!   read in parallel. Inbox mode takes the lease too: one instance receives a topic at a
//!   time, so its rows are stored in the stream's order, and every instance's processors
//!   handle them, each key in that order.
//!
//! ```no_run
//! # #[cfg(feature = "nats")]
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! # #[derive(serde::Deserialize, serde::Serialize, outbox_runtime::OutboxEvent)]
//! # #[outbox(topic = "payment.events", aggregate_type = "Payment")]
//! # struct PaymentSucceeded { #[outbox(aggregate_id)] payment_id: uuid::Uuid }
//! # #[outbox_runtime::inbox_handler]
//! # async fn mark_order_paid(event: PaymentSucceeded, tx: &mut sqlx::PgConnection)
//! #     -> Result<(), outbox_runtime::inbox::HandlerError> { let _ = (event, tx); Ok(()) }
//! use outbox_runtime::inbox::Consumer;
//! use outbox_runtime::relay::JetStream;
//!
//! let client = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let consumer = Consumer::builder(pool)
//!     .jetstream(JetStream::new(client))   // instead of .brokers(...)
//!     .group_id("orders-service")
//!     .handler(mark_order_paid)
//!     .build()?;
//! # let _ = consumer; Ok(()) }
//! ```
//!
//! # RabbitMQ
//!
//! With the `rabbitmq` feature, [`rabbitmq`](ConsumerBuilder::rabbitmq) reads from RabbitMQ
//! (a build with only `rabbitmq` has consumers and no librdkafka). The handlers, state,
//! metadata, modes, upcasters, dedup keys and CloudEvents (the `cloudEvents:*` headers) are the
//! same; the broker's half is [`RabbitMq`](crate::rabbitmq::RabbitMq)'s topology:
//!
//! - **A queue per shard and group**, `<topic>.<group>.<shard>` (quorum, durable), bound to the
//!   topic's exchange by its shard number, with a **single active consumer**: however many
//!   instances of a group run, one reads a shard at a time, in the queue's order, and another
//!   takes over (what was not acknowledged first) when it goes away. So a key's order holds in
//!   both modes across instances, as a Kafka partition's does.
//! - **Redeliveries in order**: a quorum queue hands back what a departing consumer held, in
//!   order and ahead of the rest, but puts a message handed back a second time behind the
//!   others (two sessions in a row ending before it was settled: a node restart, two crashes).
//!   So each message names its key's previous one (`outbox_previous_event_id`, set by the
//!   relay for the keys it published since it started) and carries its `outbox_id`, and the
//!   reader sends back behind the returns a redelivered message whose predecessor the
//!   database does not hold yet (once: it may be behind), and any whose key has an earlier
//!   message sent back and not settled. These trips raise the server's `x-delivery-count` (and
//!   count toward the queue's delivery limit) but not the handler's `attempt` nor the retries'
//!   count, unless the session ends before the message is settled.
//! - **Acknowledged after the commit**, with a bounded prefetch (two batches); a redelivered
//!   message is a duplicate, skipped.
//! - **Retries** wait in the shard's delay queue `<queue>.retry` (the backoff as the message's
//!   expiration, dead-lettered back to the shard queue when due, an `outbox_retry_attempts`
//!   header counting): nothing else waits for them. [`RetryPolicy::InPlace`] retries in the
//!   consumer, as on Kafka, and keeps the key's order.
//! - **Dead letters** go to `<topic>.dlq` with the Kafka dead letters' fields (`dlq_error`,
//!   `dlq_attempts`, `dlq_source_topic`, `dlq_source_partition` the shard, `dlq_source_offset`
//!   0, and `dlq_group`), confirmed before the original is acknowledged. A message that keeps
//!   coming back unacknowledged (a handler that takes the process down) is dead-lettered by the
//!   server at the queue's delivery limit (20).
//! - **Connections are supervised here**: every wait is under a timeout, and a closed
//!   connection or channel is opened again; a missing queue (with
//!   `declare_topology(false)`) is waited for, with the gauge `outbox_consumer_missing_topic`.
//!
//! ```no_run
//! # #[cfg(feature = "rabbitmq")]
//! # fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! # #[derive(serde::Deserialize, serde::Serialize, outbox_runtime::OutboxEvent)]
//! # #[outbox(topic = "payment.events", aggregate_type = "Payment")]
//! # struct PaymentSucceeded { #[outbox(aggregate_id)] payment_id: uuid::Uuid }
//! # #[outbox_runtime::inbox_handler]
//! # async fn mark_order_paid(event: PaymentSucceeded, tx: &mut sqlx::PgConnection)
//! #     -> Result<(), outbox_runtime::inbox::HandlerError> { let _ = (event, tx); Ok(()) }
//! use outbox_runtime::inbox::Consumer;
//! use outbox_runtime::rabbitmq::RabbitMq;
//!
//! let consumer = Consumer::builder(pool)
//!     .rabbitmq(RabbitMq::new("amqp://guest:guest@127.0.0.1:5672"))   // instead of .brokers(...)
//!     .group_id("orders-service")
//!     .handler(mark_order_paid)
//!     .build()?;
//! # let _ = consumer; Ok(()) }
//! ```
//!
//! # Status and metrics
//!
//! [`Consumer::inbox_status`] gives the inbox backlog figures (per topic:
//! [`admin::status`](crate::admin::status)). Consumers
//! record metrics through the [`metrics`](https://docs.rs/metrics) facade (their names and what to
//! alert on: the
//! [operations guide](https://github.com/outbox-rs/outbox/blob/main/docs/operations.md#metrics));
//! each handler call runs in a `tracing` span, `outbox_consume` in dedup mode (with the event id
//! and the handler's name) or `outbox_inbox_row` in inbox mode (with the event id and the topic),
//! whose parent, with the `opentelemetry` feature, is the producer's trace ([`crate::trace`]).

#[cfg(feature = "_broker")]
pub(crate) mod batch;
#[cfg(all(feature = "_broker", feature = "mysql"))]
pub(crate) mod batch_mysql;
#[cfg(feature = "_broker")]
mod builder;
#[cfg(feature = "_broker")]
mod consumer;
#[cfg(feature = "_broker")]
pub(crate) mod database;
#[cfg(feature = "_broker")]
pub(crate) mod dedup;
#[cfg(feature = "_broker")]
pub(crate) mod failure;
#[cfg(feature = "_broker")]
pub(crate) mod floor;
mod handler;
#[cfg(feature = "_broker")]
mod ladder;
#[cfg(feature = "_broker")]
#[allow(dead_code)] // used by the brokers whose groups read a topic under a lease (JetStream)
pub(crate) mod lease;
#[cfg(feature = "_broker")]
pub(crate) mod message;
pub(crate) mod meta;
#[cfg(feature = "_broker")]
mod processor;
#[cfg(feature = "_broker")]
pub(crate) mod receive;
#[cfg(feature = "_broker")]
pub(crate) mod route;
#[cfg(feature = "_broker")]
pub(crate) mod settings;
#[cfg(feature = "_broker")]
mod shards;
#[cfg(feature = "_broker")]
pub(crate) mod shared;
#[cfg(feature = "_broker")]
pub(crate) mod source;
#[cfg(feature = "_broker")]
mod upcast;

#[cfg(feature = "_broker")]
pub use crate::store::inbox::InboxStatus;
#[cfg(feature = "_broker")]
pub use builder::ConsumerBuilder;
#[cfg(feature = "_broker")]
pub use consumer::Consumer;
#[cfg(feature = "_broker")]
pub use database::ConsumerDatabase;
pub use handler::{BoxError, BoxFuture, Handler, HandlerError};

/// Hook of this project's own tests and benchmarks (feature `testing`); not API:
/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of the claim of `limit` rows of a processor that
/// holds every shard, in a transaction rolled back, from the floor once it settled (within a
/// minute; else from the bottom).
#[cfg(all(feature = "testing", feature = "_broker"))]
#[doc(hidden)]
pub async fn explain_claim(pool: &sqlx::PgPool, limit: usize) -> crate::Result<serde_json::Value> {
    let floor = claim_floor(pool, std::time::Duration::from_secs(60)).await?;
    crate::store::inbox::explain_claim(pool, limit, floor.unwrap_or(floor::NONE)).await
}

/// Hook of this project's own tests and benchmarks (feature `testing`); not API:
/// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of a receipt of one new row by a connection whose
/// prepared insert was planned before `between` (the generic plan it keeps), before and after.
#[cfg(all(feature = "testing", feature = "_broker"))]
#[doc(hidden)]
pub async fn explain_receipt(
    pool: &sqlx::PgPool,
    between: impl std::future::Future<Output = ()>,
) -> crate::Result<(serde_json::Value, serde_json::Value)> {
    crate::store::inbox::explain_receipt(pool, between).await
}

/// Hook of this project's own tests and benchmarks (feature `testing`); not API: the
/// processors' floor, computed afresh until a sighting settles (`None`: not within `within`).
#[cfg(all(feature = "testing", feature = "_broker"))]
#[doc(hidden)]
pub async fn claim_floor(
    pool: &sqlx::PgPool,
    within: std::time::Duration,
) -> crate::Result<Option<i64>> {
    floor::Floor::settled(pool, within).await
}
pub use meta::MessageMeta;
#[cfg(feature = "_broker")]
pub use settings::{Mode, RetryPolicy};
