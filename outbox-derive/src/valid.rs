//! Checks the parsed input and turns it into what expansion needs, reporting every problem.

use proc_macro2::Span;
use syn::{LitStr, Path};

use crate::ast::{Field, Input};
use crate::attr::{self, StructAttrs};
use crate::ctxt::Ctxt;

/// Longest topic name Kafka accepts.
const MAX_TOPIC_LEN: usize = 249;

/// A valid event definition.
pub struct Event<'i, 'a> {
    pub input: &'i Input<'a>,
    pub krate: Path,
    pub topic: LitStr,
    pub aggregate_type: LitStr,
    pub event_type: LitStr,
    pub aggregate_id: &'i Field<'a>,
    /// The partition key field: the `#[outbox(key)]` field, or else the aggregate id.
    pub key: &'i Field<'a>,
    pub event_id: Option<&'i Field<'a>>,
    /// The payload's schema version (1 unless given).
    pub version: u32,
}

/// Checks a Kafka topic name: 1 to 249 characters from `[a-zA-Z0-9._-]`, not `.` or `..`.
pub fn topic_error(topic: &str) -> Option<String> {
    if topic.is_empty() {
        return Some("topic must not be empty".into());
    }
    if topic == "." || topic == ".." {
        return Some(format!("`{topic}` is not a legal Kafka topic name"));
    }
    if topic.len() > MAX_TOPIC_LEN {
        return Some(format!(
            "topic is {} characters long; Kafka allows at most {MAX_TOPIC_LEN}",
            topic.len()
        ));
    }
    if let Some(bad) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Some(format!(
            "`{topic}` is not a legal Kafka topic name: {bad:?} is not allowed \
             (legal characters are ASCII letters, digits, `.`, `_` and `-`)"
        ));
    }
    None
}

fn required(
    cx: &mut Ctxt,
    attrs: &StructAttrs,
    value: &Option<LitStr>,
    name: &str,
    fallback_span: Span,
) -> Option<LitStr> {
    match value {
        // Present with a bad value: that error is already reported.
        None if attrs.invalid.contains(&name) => None,
        None => {
            cx.error_at(
                fallback_span,
                format!("missing `{name}`: add `#[outbox({name} = \"...\")]` to the struct"),
            );
            None
        }
        Some(v) => non_empty(cx, v, name),
    }
}

fn non_empty(cx: &mut Ctxt, value: &LitStr, name: &str) -> Option<LitStr> {
    if value.value().trim().is_empty() {
        cx.error_spanned_by(value, format!("`{name}` must not be empty"));
        None
    } else {
        Some(value.clone())
    }
}

/// The single field carrying `flag`, reporting a second one.
fn unique_field<'i, 'a>(
    cx: &mut Ctxt,
    fields: &'i [Field<'a>],
    name: &str,
    flag: impl Fn(&Field) -> Option<Span>,
) -> Option<&'i Field<'a>> {
    let mut found: Option<&Field> = None;
    for field in fields {
        if let Some(span) = flag(field) {
            if found.is_some() {
                cx.error_at(
                    span,
                    format!("only one field may be marked `#[outbox({name})]`"),
                );
            } else {
                found = Some(field);
            }
        }
    }
    found
}

pub fn validate<'i, 'a>(cx: &mut Ctxt, input: &'i Input<'a>) -> Option<Event<'i, 'a>> {
    let attrs = &input.attrs;
    let anchor = attrs.attr_span.unwrap_or_else(|| input.ident.span());

    let topic = required(cx, attrs, &attrs.topic, attr::TOPIC, anchor);
    if let Some(topic) = &topic {
        if let Some(msg) = topic_error(&topic.value()) {
            cx.error_spanned_by(topic, msg);
        }
    }
    let aggregate_type = required(
        cx,
        attrs,
        &attrs.aggregate_type,
        attr::AGGREGATE_TYPE,
        anchor,
    );
    let event_type = match &attrs.event_type {
        Some(v) => non_empty(cx, v, attr::EVENT_TYPE),
        None => Some(LitStr::new(&input.ident.to_string(), input.ident.span())),
    };

    let aggregate_id = unique_field(cx, &input.fields, attr::AGGREGATE_ID, |f| {
        f.attrs.aggregate_id
    });
    let key = unique_field(cx, &input.fields, attr::KEY, |f| f.attrs.key);
    let event_id = unique_field(cx, &input.fields, attr::EVENT_ID, |f| f.attrs.event_id);
    if aggregate_id.is_none() && input.fields_checkable {
        cx.error_at(
            input.ident.span(),
            "missing aggregate id: mark one field `#[outbox(aggregate_id)]` \
             (it is also the partition key unless a field is marked `#[outbox(key)]`)",
        );
    }

    let krate = input.crate_path();
    let aggregate_id = aggregate_id?;
    Some(Event {
        input,
        krate,
        topic: topic?,
        aggregate_type: aggregate_type?,
        event_type: event_type?,
        aggregate_id,
        key: key.unwrap_or(aggregate_id),
        event_id,
        version: attrs.version.unwrap_or(1),
    })
}
