//! Runs `outbox_runtime::migrate` against the database URL given as the only argument; the
//! migration tests start several of these at once.

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let url = std::env::args()
        .nth(1)
        .expect("usage: outbox-test-migrate DATABASE_URL");
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    if let Err(e) = outbox_runtime::migrate(&pool).await {
        eprintln!("error: {}", outbox_runtime::error_chain(&e));
        std::process::exit(1);
    }
}
