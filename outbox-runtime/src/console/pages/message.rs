//! A page that says one thing (an error, a refusal, nothing to do), with a link back.

use maud::{html, Markup};

use super::frame::{layout, Nav, Page};

pub(in crate::console) fn message(page: &Page<'_>, title: &str, text: &str) -> Markup {
    message_back(page, title, text, &page.link("/"))
}

pub(in crate::console) fn message_back(
    page: &Page<'_>,
    title: &str,
    text: &str,
    back: &str,
) -> Markup {
    let content = html! {
        h1 { (title) }
        p #message { (text) }
        p { a href=(back) { "Back" } }
    };
    layout(page, title, Nav::None, false, content)
}
