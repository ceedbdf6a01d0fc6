//! Routing: each registered handler with its event type erased (it takes the JSON payload)
//! and its state bound, its panics caught; the table from (topic, event type) to handlers.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::Arc;

use super::database::{Conn, ConsumerDatabase};
use super::failure::{panic_message, Failure};
use super::handler::{BoxFuture, Handler};
use super::meta::MessageMeta;
use super::upcast::Upcasters;
use crate::event::OutboxEvent;

/// A handler with its event type erased (it takes the JSON payload), its state bound and its
/// database's connection erased (it takes its own database's [`Conn`]).
pub(crate) trait ErasedHandler: Send + Sync {
    /// Its name, as in error messages.
    fn name(&self) -> &str;
    /// Its deduplication key in `consumer group`.
    fn dedup_key(&self, group: &str) -> String;
    /// The Rust type of its event (upcasters are registered by it).
    fn event_type_id(&self) -> TypeId;
    /// Whether it takes payloads of `version` as they are (else an upcaster makes its event).
    fn accepts_version(&self, version: u32) -> bool;
    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: Conn<'a>,
        meta: &'a MessageMeta<'a>,
        upcasters: &'a Upcasters,
    ) -> BoxFuture<'a, Result<(), Failure>>;
}

/// A handler, the state it is called with, and the database it joins.
struct Erased<H, S, D> {
    handler: H,
    state: Arc<S>,
    database: std::marker::PhantomData<fn() -> D>,
}

impl<S, D, H> ErasedHandler for Erased<H, S, D>
where
    S: Send + Sync + 'static,
    D: ConsumerDatabase,
    H: Handler<S, D>,
{
    fn name(&self) -> &str {
        self.handler.name()
    }

    fn dedup_key(&self, group: &str) -> String {
        self.handler.dedup_key(group)
    }

    fn event_type_id(&self) -> TypeId {
        TypeId::of::<H::Event>()
    }

    fn accepts_version(&self, version: u32) -> bool {
        self.handler.accepts_version(version)
    }

    fn handle_json<'a>(
        &'a self,
        payload: &'a [u8],
        conn: Conn<'a>,
        meta: &'a MessageMeta<'a>,
        upcasters: &'a Upcasters,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        use std::task::Poll;
        Box::pin(async move {
            // The builder registers only handlers of its own database.
            let conn = D::conn(conn).expect("a handler is called on its own database");
            // A panic (in the event's `Deserialize`, the call or while polling) is the
            // handler's failure, not the consumer's end.
            let panicked = |p: Box<dyn std::any::Any + Send>| {
                Failure::Panicked(format!(
                    "handler `{}` panicked: {}",
                    self.handler.name(),
                    panic_message(p.as_ref())
                ))
            };
            let event: H::Event =
                catch_unwind(AssertUnwindSafe(|| self.event(payload, meta, upcasters)))
                    .map_err(panicked)??;
            let mut future = catch_unwind(AssertUnwindSafe(|| {
                self.handler.handle(event, conn, &self.state, meta)
            }))
            .map_err(panicked)?;
            let result = std::future::poll_fn(|cx| {
                match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
                    Ok(Poll::Pending) => Poll::Pending,
                    Ok(Poll::Ready(result)) => Poll::Ready(Ok(result)),
                    Err(p) => Poll::Ready(Err(p)),
                }
            })
            .await
            .map_err(panicked)?;
            let name = self.handler.name();
            result.map_err(|error| Failure::of_handler(name, error))
        })
    }
}

impl<S, D, H> Erased<H, S, D>
where
    S: Send + Sync + 'static,
    D: ConsumerDatabase,
    H: Handler<S, D>,
{
    /// The handler's event: the payload as it is if the handler takes its schema version,
    /// else what the upcaster from that version makes of it. Neither is a permanent failure.
    fn event(
        &self,
        payload: &[u8],
        meta: &MessageMeta<'_>,
        upcasters: &Upcasters,
    ) -> Result<H::Event, Failure> {
        let version = meta.schema_version;
        let name = self.handler.name();
        let type_name = std::any::type_name::<H::Event>();
        if self.handler.accepts_version(version) {
            return serde_json::from_slice(payload).map_err(|e| {
                Failure::Permanent(format!(
                    "payload does not deserialize into `{type_name}` (handler `{name}`): {e}"
                ))
            });
        }
        let Some(upcast) = upcasters.get::<H::Event>(version) else {
            return Err(Failure::Permanent(format!(
                "schema version {version} of `{}` is not accepted by handler `{name}` (its \
                 event `{type_name}` is version {}): no upcaster from version {version} is \
                 registered",
                meta.event_type,
                <H::Event as OutboxEvent>::SCHEMA_VERSION,
            )));
        };
        let upcast_failed = |e: &dyn std::fmt::Display| {
            Failure::Permanent(format!(
                "upcasting version {version} of `{}` to `{type_name}` failed (handler \
                 `{name}`): {e}",
                meta.event_type
            ))
        };
        let json: serde_json::Value =
            serde_json::from_slice(payload).map_err(|e| upcast_failed(&e))?;
        upcast(json).map_err(|e| upcast_failed(&crate::error_chain(e.as_ref())))
    }
}

/// A registered handler, its deduplication key, and the consumer's upcasters.
#[derive(Clone)]
pub(crate) struct Route {
    pub(crate) handler: Arc<dyn ErasedHandler>,
    /// `processed_event.handler` of its rows (set by [`Routes::bind_group`]).
    pub(crate) key: String,
    upcasters: Arc<Upcasters>,
}

impl Route {
    /// Runs the handler on a message in the transaction `conn` is in.
    pub(crate) fn handle<'a>(
        &'a self,
        payload: &'a [u8],
        conn: Conn<'a>,
        meta: &'a MessageMeta<'a>,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        self.handler
            .handle_json(payload, conn, meta, &self.upcasters)
    }
}

/// Handlers by (topic, event type).
#[derive(Default, Clone)]
pub(crate) struct Routes {
    routes: HashMap<(String, String), Vec<Route>>,
}

impl Routes {
    /// Registers `handler`, to be called with `state`.
    pub(crate) fn add<S: Send + Sync + 'static, D: ConsumerDatabase, H: Handler<S, D>>(
        &mut self,
        handler: H,
        state: Arc<S>,
    ) -> Result<(), String> {
        let key = (
            <H::Event as OutboxEvent>::TOPIC.to_owned(),
            <H::Event as OutboxEvent>::EVENT_TYPE.to_owned(),
        );
        let event_type = <H::Event as OutboxEvent>::EVENT_TYPE;
        let list = self.routes.entry(key).or_default();
        if handler.name().is_empty() {
            return Err(format!(
                "a handler of `{}` has an empty name",
                std::any::type_name::<H>()
            ));
        }
        if list.iter().any(|r| r.handler.name() == handler.name()) {
            return Err(format!(
                "handler `{}` is registered twice for event `{}` (two instances of one handler \
                 type need different names)",
                handler.name(),
                event_type
            ));
        }
        list.push(Route {
            handler: Arc::new(Erased {
                handler,
                state,
                database: std::marker::PhantomData::<fn() -> D>,
            }),
            key: String::new(),
            upcasters: Arc::default(),
        });
        Ok(())
    }

    /// Gives every handler the consumer's upcasters; refuses one no handler would ever call:
    /// no handler takes its event, or every handler of its event takes its version as it is.
    pub(crate) fn bind_upcasters(&mut self, upcasters: Upcasters) -> Result<(), String> {
        let handlers: Vec<&dyn ErasedHandler> = self.all().map(|r| &*r.handler).collect();
        let unused = upcasters.registered().find_map(|(event, name, from)| {
            let mut of_event = handlers
                .iter()
                .filter(|h| h.event_type_id() == event)
                .peekable();
            if of_event.peek().is_none() {
                return Some(format!(
                    "an upcaster to `{name}` (from version {from}) is registered, but no \
                     handler takes `{name}`"
                ));
            }
            of_event.all(|h| h.accepts_version(from)).then(|| {
                format!(
                    "an upcaster to `{name}` from version {from} would never run: every \
                     handler of `{name}` takes version {from} itself (its `versions`)"
                )
            })
        });
        if let Some(e) = unused {
            return Err(e);
        }
        let upcasters = Arc::new(upcasters);
        for route in self.routes.values_mut().flatten() {
            route.upcasters = Arc::clone(&upcasters);
        }
        Ok(())
    }

    /// Sets every handler's deduplication key for consumer group `group`; refuses two
    /// handlers of one event with the same key.
    pub(crate) fn bind_group(&mut self, group: &str) -> Result<(), String> {
        for list in self.routes.values_mut() {
            for route in list.iter_mut() {
                route.key = route.handler.dedup_key(group);
            }
            let mut keys: Vec<&str> = list.iter().map(|r| r.key.as_str()).collect();
            keys.sort_unstable();
            if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
                return Err(format!(
                    "two handlers of one event share the deduplication key `{}`",
                    w[0]
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn get(&self, topic: &str, event_type: &str) -> &[Route] {
        self.routes
            .get(&(topic.to_owned(), event_type.to_owned()))
            .map_or(&[], Vec::as_slice)
    }

    /// Every registered handler.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Route> {
        self.routes.values().flatten()
    }

    pub(crate) fn topics(&self) -> Vec<String> {
        let mut topics: Vec<String> = self.routes.keys().map(|(t, _)| t.clone()).collect();
        topics.sort();
        topics.dedup();
        topics
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}
