//! Runnable examples: see `quickstart.rs` and the README.
