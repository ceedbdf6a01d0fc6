//! Connections to RabbitMQ, supervised here rather than by the client: every wait for the
//! server is under a timeout, and a connection or channel that closed (the server restarted,
//! a heartbeat was missed, a channel error) is dropped and opened again by whoever holds it,
//! on its next use. amqprs reconnects nothing by itself, and what it would have done
//! silently (a publish into a closed connection, a consumer whose deliveries stopped) is what
//! users of RabbitMQ clients report as hangs.

use std::future::Future;
use std::time::Duration;

use amqprs::callbacks::{ChannelCallback, ConnectionCallback};
use amqprs::channel::{Channel, ConfirmSelectArguments};
use amqprs::connection::{Connection, OpenConnectionArguments};
use amqprs::{Ack, BasicProperties, Cancel, Close, CloseChannel, Nack, Return};

use super::settings::RabbitMq;

/// The connection arguments `settings` give, named `name` (shown by the server).
pub(crate) fn arguments(
    settings: &RabbitMq,
    name: &str,
) -> Result<OpenConnectionArguments, String> {
    let mut args = OpenConnectionArguments::try_from(settings.url.as_str()).map_err(|e| {
        format!(
            "the RabbitMQ URL `{}` cannot be used: {e}",
            settings.redacted_url()
        )
    })?;
    let heartbeat = u16::try_from(settings.heartbeat.as_secs().max(1)).unwrap_or(u16::MAX);
    args.heartbeat(heartbeat)
        .connection_name(&format!("outbox {name}"));
    Ok(args)
}

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

/// An open connection and one channel on it.
pub(crate) struct Link {
    pub(crate) connection: Connection,
    pub(crate) channel: Channel,
}

impl Link {
    /// Connects to the server and opens a channel, each step within `within`.
    pub(crate) async fn open(
        settings: &RabbitMq,
        name: &str,
        within: Duration,
    ) -> Result<Link, String> {
        let args = arguments(settings, name)?;
        let url = settings.redacted_url();
        let connection = timed(
            within,
            &format!("cannot connect to RabbitMQ at {url}"),
            Connection::open(&args),
        )
        .await?;
        // Callbacks that only log: without them the client logs an error for each event.
        let _ = connection.register_callback(Logged).await;
        let channel = open_channel(&connection, within).await?;
        Ok(Link {
            connection,
            channel,
        })
    }

    /// Opens a channel in confirm mode, with `callback` told of each confirm and return.
    pub(crate) async fn confirming<C: ChannelCallback + Send + 'static>(
        settings: &RabbitMq,
        name: &str,
        within: Duration,
        callback: C,
    ) -> Result<Link, String> {
        let link = Link::open(settings, name, within).await?;
        timed(
            within,
            "cannot register for confirms",
            link.channel.register_callback(callback),
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
/// server closes a channel whose passive declare found nothing).
pub(crate) async fn open_channel(
    connection: &Connection,
    within: Duration,
) -> Result<Channel, String> {
    let channel = timed(
        within,
        "cannot open a channel",
        connection.open_channel(None),
    )
    .await?;
    let _ = channel.register_callback(Logged).await;
    Ok(channel)
}

/// Callbacks that log what the server says and do nothing else.
struct Logged;

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
impl ChannelCallback for Logged {
    async fn close(
        &mut self,
        channel: &Channel,
        close: CloseChannel,
    ) -> std::result::Result<(), amqprs::error::Error> {
        tracing::debug!(channel = %channel, %close, "RabbitMQ closed a channel");
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
