//! What every page shares: the request's view of the console ([`Page`]), and the frame around
//! a page's content (navigation, sign-in, the health warnings, the footer).

use std::sync::Arc;

use axum::http::HeaderMap;
use chrono::Utc;
use maud::{html, Markup, DOCTYPE};

use super::format::{count, time};
use crate::admin::Health;
use crate::console::{auth, Console};

/// The health warnings for the top of a page.
pub(in crate::console) enum Warnings {
    Checked(Arc<Health>),
    /// The check failed: its error.
    Failed(String),
}

/// What every page needs: the console, whether the request may act, the warnings.
pub(in crate::console) struct Page<'a> {
    pub(super) console: &'a Console,
    signed_in: bool,
    warnings: Option<Warnings>,
}

impl<'a> Page<'a> {
    pub(in crate::console) fn new(
        console: &'a Console,
        headers: &HeaderMap,
        warnings: Option<Warnings>,
    ) -> Self {
        Page {
            console,
            signed_in: auth::signed_in(console, headers),
            warnings,
        }
    }

    /// Whether the page offers actions: allowed, and the request carries the token.
    pub(super) fn actions(&self) -> bool {
        self.console.settings.actions_allowed() && self.signed_in
    }

    pub(super) fn link(&self, path: &str) -> String {
        self.console.link(path)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Nav {
    Overview,
    Relays,
    Parked,
    Dead,
    Event,
    None,
}

pub(super) fn layout(
    page: &Page<'_>,
    title: &str,
    nav: Nav,
    refresh: bool,
    content: Markup,
) -> Markup {
    let settings = &page.console.settings;
    let item = |target: Nav, path: &str, label: &str| {
        html! {
            a href=(page.link(path)) class=[(nav == target).then_some("active")] { (label) }
        }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox console" }
                link rel="stylesheet" href=(page.link("/assets/console.css"));
                script src=(page.link("/assets/console.js")) defer {}
            }
            body {
                header {
                    nav {
                        strong { "outbox" }
                        (item(Nav::Overview, "/", "Overview"))
                        (item(Nav::Relays, "/relays", "Relays"))
                        (item(Nav::Parked, "/parked", "Parked"))
                        (item(Nav::Dead, "/dead", "Dead"))
                        (item(Nav::Event, "/event", "Find an event"))
                    }
                    form.find method="get" action=(page.link("/event")) {
                        input type="search" name="id" placeholder="event id or outbox id" aria-label="event id";
                    }
                    div.who {
                        @if !settings.actions_allowed() {
                            span.mode { "read-only" }
                        } @else if page.signed_in {
                            form method="post" action=(page.link("/logout")) {
                                button.link type="submit" { "sign out" }
                            }
                        } @else {
                            a href=(page.link("/login")) { "sign in to act" }
                        }
                    }
                }
                div #page data-refresh=[refresh.then(|| settings.refresh_interval.as_secs())] {
                    (warnings(page))
                    main { (content) }
                    footer {
                        "Read at " (time(Utc::now())) "."
                        @if refresh {
                            " Refreshes every " (settings.refresh_interval.as_secs()) " s."
                        }
                    }
                }
            }
        }
    }
}

fn warnings(page: &Page<'_>) -> Markup {
    html! {
        @match &page.warnings {
            None => {}
            Some(Warnings::Failed(error)) => {
                section.warnings { p { "The health check failed: " (error) } }
            }
            Some(Warnings::Checked(health)) if health.warnings.is_empty() => {
                p.healthy { "No health warnings." }
            }
            Some(Warnings::Checked(health)) => {
                section.warnings #warnings {
                    h2 { (count(health.warnings.len() as i64, "health warning", "health warnings")) }
                    ul {
                        @for w in &health.warnings {
                            li data-kind=(w.kind().as_str()) { strong { (w.kind().as_str()) } ": " (w.to_string()) }
                        }
                    }
                }
            }
        }
    }
}
