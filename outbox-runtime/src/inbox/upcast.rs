//! [`Upcasters`]: what makes a handler's event from an older schema version's payload.

use std::any::{Any, TypeId};
use std::collections::HashMap;

use super::handler::BoxError;
use crate::event::OutboxEvent;

/// An upcaster to `E`: the JSON payload of an older version in, the event out.
pub(crate) type UpcastFn<E> =
    dyn Fn(serde_json::Value) -> Result<E, BoxError> + Send + Sync + 'static;

/// Upcasters by event type and the version they read.
#[derive(Default)]
pub(crate) struct Upcasters {
    /// Each value is a `Box<UpcastFn<E>>` for the `E` of its key's `TypeId`.
    by_event: HashMap<(TypeId, u32), Box<dyn Any + Send + Sync>>,
    /// The event types they make, by name, for errors.
    names: Vec<(TypeId, &'static str, u32)>,
}

impl Upcasters {
    /// Registers `f` to make an `E` from a payload of version `from`.
    pub(crate) fn add<E: OutboxEvent + 'static>(
        &mut self,
        from: u32,
        f: Box<UpcastFn<E>>,
    ) -> Result<(), String> {
        let name = std::any::type_name::<E>();
        if from == 0 {
            return Err(format!(
                "an upcaster to `{name}` from version 0: versions start at 1"
            ));
        }
        if from == E::SCHEMA_VERSION {
            return Err(format!(
                "an upcaster to `{name}` from version {from}, its own version: a payload of \
                 that version is deserialized as it is"
            ));
        }
        let key = (TypeId::of::<E>(), from);
        if self.by_event.contains_key(&key) {
            return Err(format!("two upcasters to `{name}` from version {from}"));
        }
        self.by_event.insert(key, Box::new(f));
        self.names.push((key.0, name, from));
        Ok(())
    }

    /// The upcaster to `E` from `version`, if one is registered.
    pub(crate) fn get<E: 'static>(&self, version: u32) -> Option<&UpcastFn<E>> {
        self.by_event
            .get(&(TypeId::of::<E>(), version))
            // The key's `TypeId` is `E`'s: the downcast cannot fail.
            .and_then(|f| f.downcast_ref::<Box<UpcastFn<E>>>())
            .map(|f| &**f)
    }

    /// Every upcaster registered: the event type it makes (its `TypeId` and name) and the
    /// version it reads.
    pub(crate) fn registered(&self) -> impl Iterator<Item = (TypeId, &'static str, u32)> + '_ {
        self.names.iter().copied()
    }
}
