//! The `--demo` report's latency, as a user has it: from an order's commit to the first call
//! of the payments handler with its `OrderCreated` (one hop, dedup mode), and to the first
//! call of the orders handler with its `PaymentSucceeded` (the round trip: both hops, the
//! second in inbox mode, or dedup mode on MariaDB). Start-up is excluded: the demo posts its orders once the server
//! listens, and every order counts (a consumer that joins late shows in the figures).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// A handler the latency is measured to.
#[derive(Clone, Copy)]
pub enum Handler {
    /// The payments service's `charge_order`.
    Payments,
    /// The orders service's `mark_order_paid`.
    Orders,
}

/// Per order: when it committed, when each handler was first called with its event.
#[derive(Default)]
struct Times {
    committed: Option<Instant>,
    payments: Option<Instant>,
    orders: Option<Instant>,
}

static ORDERS: Mutex<Option<HashMap<Uuid, Times>>> = Mutex::new(None);

fn with_times(order: Uuid, f: impl FnOnce(&mut Times)) {
    let mut orders = ORDERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    f(orders
        .get_or_insert_with(HashMap::new)
        .entry(order)
        .or_default());
}

/// `order` committed, now.
pub fn committed(order: Uuid) {
    let now = Instant::now();
    with_times(order, |t| t.committed = Some(now));
}

/// `handler` was called with `order`'s event, now (only its first call counts: a retry is a
/// later call).
pub fn handled(handler: Handler, order: Uuid) {
    let now = Instant::now();
    with_times(order, |t| {
        let at = match handler {
            Handler::Payments => &mut t.payments,
            Handler::Orders => &mut t.orders,
        };
        at.get_or_insert(now);
    });
}

/// `p50 X ms, p99 Y ms` of `handler` over `orders`.
fn quantiles(orders: &[Uuid], handler: Handler) -> String {
    let times = ORDERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut latencies: Vec<Duration> = orders
        .iter()
        .filter_map(|id| {
            let t = times.as_ref()?.get(id)?;
            let handled = match handler {
                Handler::Payments => t.payments,
                Handler::Orders => t.orders,
            }?;
            Some(handled.saturating_duration_since(t.committed?))
        })
        .collect();
    if latencies.is_empty() {
        return "none measured".to_owned();
    }
    latencies.sort();
    let at = |p: f64| {
        let i = ((latencies.len() as f64 * p) as usize).min(latencies.len() - 1);
        latencies[i].as_secs_f64() * 1000.0
    };
    format!("p50 {:.1} ms, p99 {:.1} ms", at(0.5), at(0.99))
}

/// The report's lines for `orders`, whose orders consumer ran in `orders_mode`.
pub fn report(orders: &[Uuid], orders_mode: &str) -> [String; 2] {
    [
        format!(
            "demo: order committed -> payments handler (dedup mode): {}",
            quantiles(orders, Handler::Payments)
        ),
        format!(
            "demo: order committed -> orders handler, the round trip (then {orders_mode} mode): {}",
            quantiles(orders, Handler::Orders)
        ),
    ]
}
