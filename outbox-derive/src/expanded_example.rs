//! Keeps `examples/expanded.rs` in sync with the derive. That example shows an event's derive
//! input in a comment (between `// derive-input:begin` and `// derive-input:end`), the same
//! struct without the derive, and the derive's output written out (between
//! `// expansion:begin` and `// expansion:end`, inside a `#[rustfmt::skip]` module so that
//! rustfmt leaves prettyplease's text alone).
//!
//! `UPDATE_EXPANDED=1 cargo test -p outbox-derive` rewrites the generated section.

use std::path::PathBuf;

use quote::ToTokens as _;
use syn::{Data, DeriveInput, Item};

const INPUT: (&str, &str) = ("// derive-input:begin", "// derive-input:end");
const EXPANSION: (&str, &str) = ("// expansion:begin", "// expansion:end");
const REFRESH: &str = "UPDATE_EXPANDED=1 cargo test -p outbox-derive";

fn example_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/expanded.rs")
}

/// The lines strictly between the marker lines `begin` and `end` (matched after leading
/// whitespace), as a range of line indices; and the indentation of the `begin` line.
fn section(lines: &[&str], (begin, end): (&str, &str)) -> (std::ops::Range<usize>, String) {
    let find = |marker: &str, from: usize| {
        lines[from..]
            .iter()
            .position(|l| l.trim_start().starts_with(marker))
            .map(|i| i + from)
            .unwrap_or_else(|| panic!("examples/expanded.rs has no `{marker}` line"))
    };
    let start = find(begin, 0);
    let stop = find(end, start + 1);
    let indent = lines[start].len() - lines[start].trim_start().len();
    (start + 1..stop, lines[start][..indent].to_owned())
}

/// The commented-out derive input, uncommented.
fn derive_input(lines: &[&str]) -> DeriveInput {
    let (range, _) = section(lines, INPUT);
    let source: Vec<&str> = lines[range]
        .iter()
        .map(|line| {
            let line = line.trim_start();
            let text = line.strip_prefix("//").unwrap_or_else(|| {
                panic!("examples/expanded.rs: `{line}` in the derive input is not a comment")
            });
            text.strip_prefix(' ').unwrap_or(text)
        })
        .collect();
    syn::parse_str(&source.join("\n"))
        .unwrap_or_else(|e| panic!("examples/expanded.rs: the derive input does not parse: {e}"))
}

/// The derive's output for `input`, pretty-printed, each non-empty line indented by `indent`.
fn expansion(input: &DeriveInput, indent: &str) -> Vec<String> {
    let tokens = crate::expand::derive(input);
    let file: syn::File = syn::parse2(tokens.clone())
        .unwrap_or_else(|e| panic!("the expansion does not parse as items: {e}\n{tokens}"));
    prettyplease::unparse(&file)
        .lines()
        .map(|line| match line {
            "" => String::new(),
            line => format!("{indent}{line}"),
        })
        .collect()
}

/// A struct as the tests compare it: no struct attributes (derives, `#[outbox]`, docs) and no
/// `#[outbox]` field attributes.
fn bare(mut input: DeriveInput) -> String {
    input.attrs.clear();
    if let Data::Struct(data) = &mut input.data {
        for field in data.fields.iter_mut() {
            field.attrs.retain(|a| !a.path().is_ident("outbox"));
        }
    }
    input.into_token_stream().to_string()
}

#[test]
fn expanded_example_is_current() {
    let path = example_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    let input = derive_input(&lines);

    // The struct the example declares is the input without the derive.
    let file = syn::parse_file(&text)
        .unwrap_or_else(|e| panic!("examples/expanded.rs does not parse: {e}"));
    let declared = file
        .items
        .into_iter()
        .find_map(|item| match item {
            Item::Struct(s) if s.ident == input.ident => Some(DeriveInput::from(s)),
            _ => None,
        })
        .unwrap_or_else(|| {
            panic!(
                "examples/expanded.rs must declare `struct {}` (the derive input without the \
                 derive)",
                input.ident
            )
        });
    assert_eq!(
        bare(declared),
        bare(input.clone()),
        "examples/expanded.rs: `struct {}` differs from the commented derive input (beyond its \
         attributes): keep the two in step",
        input.ident
    );

    let (range, indent) = section(&lines, EXPANSION);
    let expected = expansion(&input, &indent);
    let actual: Vec<&str> = lines[range.clone()].iter().map(|l| l.trim_end()).collect();
    if actual == expected {
        return;
    }
    if std::env::var_os("UPDATE_EXPANDED").is_some_and(|v| !v.is_empty() && v != "0") {
        let mut out: Vec<&str> = lines[..range.start].to_vec();
        out.extend(expected.iter().map(String::as_str));
        out.extend(&lines[range.end..]);
        let mut updated = out.join("\n");
        updated.push('\n');
        std::fs::write(&path, updated)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        eprintln!("updated the expansion in {}", path.display());
        return;
    }
    let line = actual
        .iter()
        .zip(&expected)
        .position(|(a, e)| a != e)
        .unwrap_or(actual.len().min(expected.len()));
    panic!(
        "examples/expanded.rs is out of date: its expansion section differs from what the \
         derive generates, first at line {} (found `{}`, expected `{}`).\n\
         Refresh it with `{REFRESH}`, then review the diff.",
        range.start + line + 1,
        actual.get(line).copied().unwrap_or("<end of section>"),
        expected
            .get(line)
            .map_or("<end of section>", String::as_str),
    );
}
