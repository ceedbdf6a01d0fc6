//! Compile-time behaviour of `#[derive(OutboxEvent)]`: what compiles, and the errors (with their
//! spans) for what does not. Refresh snapshots with `TRYBUILD=overwrite` and review the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("pass/*.rs");
    t.compile_fail("fail/*.rs");
}
