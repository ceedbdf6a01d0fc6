//! Connections to RabbitMQ, supervised here rather than by the client: every wait for the
//! server is under a timeout, and a connection or channel that closed (the server restarted,
//! a heartbeat was missed, a channel error) is dropped and opened again by whoever holds it,
//! on its next use. amqprs reconnects nothing by itself, and what it would have done
//! silently (a publish into a closed connection, a consumer whose deliveries stopped) is what
//! users of RabbitMQ clients report as hangs.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use amqprs::callbacks::{ChannelCallback, ConnectionCallback};
use amqprs::channel::{Channel, ConfirmSelectArguments};
use amqprs::connection::Connection;
use amqprs::{Ack, BasicProperties, Cancel, Close, CloseChannel, Nack, Return};

use super::settings::RabbitMq;

/// Awaits `future` for at most `within`; `what` names it in the error.
pub(crate) async fn timed<T, E: std::fmt::Display>(
    within: Duration,
    what: &str,
    future: impl Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(within, future).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: RabbitMQ did not answer within {within:?}")),
    }
}

/// AMQP's reply code: the named exchange or queue does not exist.
pub(crate) const NOT_FOUND: u16 = 404;
/// AMQP's reply code: the user may not do this.
pub(crate) const ACCESS_REFUSED: u16 = 403;
/// AMQP's reply code: something of that name exists with other arguments.
pub(crate) const PRECONDITION_FAILED: u16 = 406;

/// What the server said when it closed a channel. A call that fails on a channel the server
/// closed only says the channel closed; the reason (404 no such exchange or queue, 406 an
/// argument that differs, 403 refused) reaches the channel's callback, which notes it here.
#[derive(Clone, Default)]
pub(crate) struct CloseReason(Arc<Mutex<Option<(u16, String)>>>);

impl CloseReason {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(u16, String)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes the server's reason for closing the channel.
    pub(crate) fn note(&self, close: &CloseChannel) {
        *self.lock() = Some((close.reply_code(), close.reply_text().clone()));
    }

    /// The server's reply code, if it closed the channel.
    pub(crate) fn code(&self) -> Option<u16> {
        self.lock().as_ref().map(|(code, _)| *code)
    }

    /// `error` with the server's reason appended, if it gave one.
    pub(crate) fn explain(&self, error: String) -> String {
        match self.lock().as_ref() {
            Some((code, text)) if !error.contains(text.as_str()) => {
                format!("{error} (RabbitMQ closed the channel: {code} {text})")
            }
            _ => error,
        }
    }
}

/// An open connection and one channel on it.
pub(crate) struct Link {
    pub(crate) connection: Connection,
    pub(crate) channel: Channel,
    /// Why the server closed `channel`, once it did.
    pub(crate) closed: CloseReason,
}

impl Link {
    /// Connects to the server and opens a channel, each step within `within`.
    pub(crate) async fn open(
        settings: &RabbitMq,
        name: &str,
        within: Duration,
    ) -> Result<Link, String> {
        let args = settings.connection_arguments(name)?;
        let url = settings.redacted_url();
        let connection = timed(
            within,
            &format!("cannot connect to RabbitMQ at {url}"),
            Connection::open(&args),
        )
        .await?;
        // Callbacks that only log: without them the client logs an error for each event.
        let _ = connection.register_callback(Logged).await;
        let (channel, closed) = open_channel(&connection, within).await?;
        Ok(Link {
            connection,
            channel,
            closed,
        })
    }

    /// Opens a channel in confirm mode, with the callback `callback` makes (given where to note
    /// a close's reason) told of each confirm and return.
    pub(crate) async fn confirming<C: ChannelCallback + Send + 'static>(
        settings: &RabbitMq,
        name: &str,
        within: Duration,
        callback: impl FnOnce(CloseReason) -> C,
    ) -> Result<Link, String> {
        let link = Link::open(settings, name, within).await?;
        timed(
            within,
            "cannot register for confirms",
            link.channel
                .register_callback(callback(link.closed.clone())),
        )
        .await?;
        timed(
            within,
            "cannot put the channel in confirm mode",
            link.channel
                .confirm_select(ConfirmSelectArguments::default()),
        )
        .await?;
        Ok(link)
    }

    /// Whether the connection and the channel are both still open.
    pub(crate) fn is_open(&self) -> bool {
        self.connection.is_open() && self.channel.is_open()
    }

    /// Closes the connection, waiting at most a second for the server (in the background).
    pub(crate) fn close(self) {
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(1), self.connection.close()).await;
        });
    }
}

/// Opens a channel on `connection` within `within` (a fresh one for each passive declare: the
/// server closes a channel whose passive declare found nothing), with where the server's
/// reason for closing it will be noted.
pub(crate) async fn open_channel(
    connection: &Connection,
    within: Duration,
) -> Result<(Channel, CloseReason), String> {
    let channel = timed(
        within,
        "cannot open a channel",
        connection.open_channel(None),
    )
    .await?;
    let closed = CloseReason::default();
    timed(
        within,
        "cannot register the channel's callback",
        channel.register_callback(Noting(closed.clone())),
    )
    .await?;
    Ok((channel, closed))
}

/// Closes `channel` in the background if it is still open, waiting at most a second.
pub(crate) fn close_channel(channel: Channel) {
    if channel.is_open() {
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(1), channel.close()).await;
        });
    }
}

/// The connection's callback: logs what the server says, does nothing else.
struct Logged;

/// A channel's callback: notes why the server closed it, logs the rest.
struct Noting(CloseReason);

#[async_trait::async_trait]
impl ConnectionCallback for Logged {
    async fn close(
        &mut self,
        connection: &Connection,
        close: Close,
    ) -> std::result::Result<(), amqprs::error::Error> {
        tracing::info!(connection = %connection, %close, "RabbitMQ closed the connection");
        Ok(())
    }

    async fn blocked(&mut self, connection: &Connection, reason: String) {
        tracing::warn!(connection = %connection, reason, "RabbitMQ blocked the connection's publishes (a resource alarm)");
    }

    async fn unblocked(&mut self, connection: &Connection) {
        tracing::info!(connection = %connection, "RabbitMQ unblocked the connection");
    }

    async fn secret_updated(&mut self, _connection: &Connection) {}
}

#[async_trait::async_trait]
impl ChannelCallback for Noting {
    async fn close(
        &mut self,
        channel: &Channel,
        close: CloseChannel,
    ) -> std::result::Result<(), amqprs::error::Error> {
        tracing::debug!(channel = %channel, %close, "RabbitMQ closed a channel");
        self.0.note(&close);
        Ok(())
    }

    async fn cancel(
        &mut self,
        channel: &Channel,
        cancel: Cancel,
    ) -> std::result::Result<(), amqprs::error::Error> {
        tracing::info!(channel = %channel, consumer = cancel.consumer_tag(), "RabbitMQ cancelled a consumer");
        Ok(())
    }

    async fn flow(
        &mut self,
        _channel: &Channel,
        active: bool,
    ) -> std::result::Result<bool, amqprs::error::Error> {
        Ok(active)
    }

    async fn publish_ack(&mut self, _channel: &Channel, _ack: Ack) {}

    async fn publish_nack(&mut self, _channel: &Channel, _nack: Nack) {}

    async fn publish_return(
        &mut self,
        _channel: &Channel,
        _ret: Return,
        _basic_properties: BasicProperties,
        _content: Vec<u8>,
    ) {
    }
}
