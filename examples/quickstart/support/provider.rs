//! The payment provider the payments service calls (its state holds the client): an
//! in-process stand-in.

use std::error::Error;
use std::fmt;

use uuid::Uuid;

/// A payment provider's client. Here an in-process stand-in for a remote API with idempotency
/// keys (as Stripe's or Adyen's): a charge repeated with the same key is the same charge.
/// Like a real one it sometimes times out after charging: every tenth new charge here.
#[derive(Default)]
pub struct PaymentProvider {
    /// Charges made, by idempotency key.
    charges: std::sync::Mutex<std::collections::HashMap<Uuid, String>>,
}

/// The provider's answer did not come: the charge may or may not have been made.
#[derive(Debug)]
pub struct ProviderTimeout;

impl fmt::Display for ProviderTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the payment provider did not answer in time")
    }
}

impl Error for ProviderTimeout {}

impl PaymentProvider {
    /// Charges `amount`, once per `idempotency_key`; returns the provider's charge id.
    pub async fn charge(
        &self,
        idempotency_key: Uuid,
        amount: i64,
    ) -> Result<String, ProviderTimeout> {
        let mut charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(charge) = charges.get(&idempotency_key) {
            return Ok(charge.clone());
        }
        let charge = format!("ch_{}_{amount}", charges.len() + 1);
        charges.insert(idempotency_key, charge.clone());
        #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87, above the MSRV
        if charges.len() % 10 == 0 {
            return Err(ProviderTimeout); // charged, but the answer was lost
        }
        Ok(charge)
    }
}
