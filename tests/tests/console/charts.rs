//! The overview's charts on a console started moments ago: their time axis starts at the first
//! sample (not an hour back, with the line a dot at the right edge) and says so; a chart with
//! nothing to draw says why.

use std::time::Duration;

use outbox_runtime::console::ConsoleSettings;
use outbox_runtime::Uow;
use outbox_tests::browser::{Browser, Served};
use outbox_tests::deposits::deposit;
use outbox_tests::TestDb;

/// Where the first point of the backlog chart's first line is, as a share of the plot's width
/// (0: its left edge, 1: its right edge).
async fn first_point(browser: &Browser) -> f64 {
    let at = browser
        .eval(
            "const svg = document.querySelector('figure.chart svg');
             const axis = svg.querySelector('line.axis');
             const path = svg.querySelector('path');
             const x = path.getPointAtLength(0).x;
             const left = axis.x1.baseVal.value, right = axis.x2.baseVal.value;
             return (x - left) / (right - left);",
        )
        .await;
    at.as_f64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_consoles_charts_start_at_their_first_sample_and_say_so() {
    let db = TestDb::new().await;
    let mut uow = Uow::begin(&db.pool).await.unwrap();
    for seq in 0..5 {
        uow.emit(&deposit(1, seq)).await.unwrap();
    }
    uow.commit().await.unwrap();
    let served = Served::start(
        &db.pool,
        ConsoleSettings::default()
            .sample_interval(Duration::from_secs(1))
            .refresh_interval(Duration::from_secs(1)),
    )
    .await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/")).await.unwrap();
    // Three samples in: the backlog's line has three points.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let points = browser
            .eval(
                "const path = document.querySelector('figure.chart svg path');
                 return path ? path.getAttribute('d').split('L').length : 0;",
            )
            .await;
        if points.as_u64().unwrap() >= 3 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no chart of three samples after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        browser.client.refresh().await.unwrap();
    }
    let x = first_point(&browser).await;
    assert!(
        x < 0.05,
        "the backlog line starts at {:.0}% of the axis, not at its left edge",
        x * 100.0
    );
    let charts = browser.text("section.charts").await;
    assert!(!charts.contains("60 min"), "{charts}");
    assert!(charts.contains("first sample"), "{charts}");
    // Nothing was published: the publish rate's chart says so rather than draw a flat line.
    let rate = browser.text("figure.chart.publish-rate").await;
    assert!(rate.contains("Nothing was published"), "{rate}");
    browser.screenshot("overview-fresh-console").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chart_with_one_sample_says_when_the_next_comes() {
    let db = TestDb::new().await;
    // A sample an hour: the first request's is the only one for a long while.
    let served = Served::start(
        &db.pool,
        ConsoleSettings::default().sample_interval(Duration::from_secs(3600)),
    )
    .await;
    let browser = Browser::start().await;
    browser.client.goto(&served.url("/")).await.unwrap();
    assert_eq!(browser.count("figure.chart").await, 2, "both charts");
    for chart in ["backlog", "publish-rate"] {
        let empty = browser.text(&format!("figure.chart.{chart} .empty")).await;
        assert!(
            empty.contains("One sample so far") && empty.contains("the next in 1 h"),
            "{chart}: {empty}"
        );
    }
    browser.screenshot("overview-one-sample").await;
    browser.close().await;
}
