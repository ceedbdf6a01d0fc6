//! trybuild cases live in `pass/` and `fail/`; `tests/compile.rs` runs them.
