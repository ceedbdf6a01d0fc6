use outbox_runtime::Uow;

#[derive(serde::Serialize)]
struct OrderCreated {
    order_id: u64,
}

async fn handler(uow: &mut Uow<'_>) -> outbox_runtime::Result<()> {
    uow.emit(&OrderCreated { order_id: 1 }).await?;
    uow.emit_all([&OrderCreated { order_id: 2 }]).await?;
    Ok(())
}

fn main() {
    let _ = handler;
}
