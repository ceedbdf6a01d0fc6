//! What a database error means to the framework: one classifier (by SQLSTATE, and by the kind
//! of sqlx error when the server did not answer), which every path matches on. Whether to try
//! again, whether the data is at fault, whether the transaction rather than the statement
//! failed: each is a question about the [`DbError`], never a list of codes of its own.

/// A database error, as the framework treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DbError {
    /// The server or the connection is away, shutting down, or out of connections (SQLSTATE
    /// class 08, 53300, 57P01 to 57P03), or no answer came at all (an I/O error, a pool that
    /// timed out or was closed): try again later. Nobody's data is at fault.
    Unavailable,
    /// Lost to a concurrent transaction: 40001 `serialization_failure`, 40P01
    /// `deadlock_detected`. Run the transaction again.
    Conflict,
    /// Waited too long: 55P03 `lock_not_available` (`lock_timeout`), 57014 `query_canceled`
    /// (`statement_timeout`, a cancel request). Try again.
    TimedOut,
    /// Any other transaction rollback (class 40: 40000, 40002, 40003): the transaction's
    /// failure rather than a statement's, but not one known to pass if tried again.
    RolledBack,
    /// 25P02 `in_failed_sql_transaction`: an earlier statement failed and aborted the
    /// transaction (its error was caught, and this statement ran anyway).
    Aborted,
    /// Class 23, an integrity constraint violation: the data fails again, however often.
    Integrity,
    /// Class 22, a data exception (a value out of range, text `jsonb` refuses): the data
    /// fails again, however often.
    Data,
    /// Anything else: a statement's own error (syntax, permissions, a missing table), or an
    /// error that is not the database's (decoding, configuration).
    Other,
}

impl DbError {
    /// Classifies `error`.
    pub(crate) fn of(error: &sqlx::Error) -> DbError {
        match error {
            #[cfg(feature = "mysql")]
            sqlx::Error::Database(e) if Self::mysql(e.as_ref()).is_some() => {
                Self::mysql(e.as_ref()).unwrap_or(DbError::Other)
            }
            sqlx::Error::Database(e) => e.code().map_or(DbError::Other, |c| Self::code(&c)),
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => DbError::Unavailable,
            _ => DbError::Other,
        }
    }

    /// MariaDB's and MySQL's error numbers whose SQLSTATE (often the catch-all HY000) does not
    /// say enough: a lock wait timeout (1205: only the statement is undone, unless
    /// `innodb_rollback_on_timeout`), a deadlock (1213), a statement timed out (3024 MySQL,
    /// 1969 MariaDB), a value a check or the JSON type refuses (4025 MariaDB, 3140 MySQL), a
    /// statement over `max_allowed_packet` (1153).
    #[cfg(feature = "mysql")]
    fn mysql(error: &dyn sqlx::error::DatabaseError) -> Option<DbError> {
        let number = error
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()?
            .number();
        match number {
            1205 | 3024 | 1969 => Some(DbError::TimedOut),
            1213 => Some(DbError::Conflict),
            // A statement bigger than `max_allowed_packet`: the same data fails again.
            4025 | 3140 | 1153 => Some(DbError::Data),
            _ => None,
        }
    }

    /// Classifies a SQLSTATE.
    fn code(code: &str) -> DbError {
        match code {
            "40001" | "40P01" => DbError::Conflict,
            "55P03" | "57014" => DbError::TimedOut,
            "25P02" => DbError::Aborted,
            "53300" | "57P01" | "57P02" | "57P03" => DbError::Unavailable,
            _ if code.starts_with("08") => DbError::Unavailable,
            _ if code.starts_with("40") => DbError::RolledBack,
            _ if code.starts_with("23") => DbError::Integrity,
            _ if code.starts_with("22") => DbError::Data,
            _ => DbError::Other,
        }
    }

    /// The class of the first sqlx error in `error`'s chain of sources (a handler's error may
    /// wrap the database's, in this crate's [`Error`](crate::Error) or the application's own).
    #[cfg_attr(not(feature = "_broker"), allow(dead_code))]
    pub(crate) fn find(error: &(dyn std::error::Error + 'static)) -> Option<DbError> {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(sqlx) = e.downcast_ref::<sqlx::Error>() {
                return Some(Self::of(sqlx));
            }
            // Transparent: its sources are the sqlx error's, which is not among them.
            if let Some(crate::Error::Database(sqlx)) = e.downcast_ref::<crate::Error>() {
                return Some(Self::of(sqlx));
            }
            next = e.source();
        }
        None
    }

    /// Doing the same work again may succeed, and the failure counts against nothing.
    pub(crate) fn is_transient(self) -> bool {
        matches!(
            self,
            DbError::Unavailable | DbError::Conflict | DbError::TimedOut
        )
    }

    /// The data is at fault: the same work fails again, however often it is tried.
    pub(crate) fn is_permanent(self) -> bool {
        matches!(self, DbError::Integrity | DbError::Data)
    }

    /// The transaction failed rather than the statement: in a transaction shared by several
    /// messages, possibly another message's doing.
    #[cfg_attr(not(feature = "_broker"), allow(dead_code))]
    pub(crate) fn is_transaction_failure(self) -> bool {
        matches!(
            self,
            DbError::Aborted | DbError::Conflict | DbError::RolledBack
        )
    }

    // The questions below are about one error more precisely than its class: each names the
    // one condition its caller handles, and leaves the class (and so every caller of `of`)
    // as it is.

    /// 42P01 `undefined_table` (42S02 on MariaDB/MySQL): the statement names a table that does
    /// not exist, such as one a migration not applied yet adds (class [`Other`](DbError::Other)).
    pub(crate) fn is_undefined_table(error: &sqlx::Error) -> bool {
        matches!(sqlstate(error).as_deref(), Some("42P01" | "42S02"))
    }

    /// 55P03 `lock_not_available`: a lock did not come within `lock_timeout` (class
    /// [`TimedOut`](DbError::TimedOut), which a `statement_timeout` is of too).
    pub(crate) fn is_lock_not_available(error: &sqlx::Error) -> bool {
        sqlstate(error).as_deref() == Some("55P03")
    }

    /// The statement needs a privilege the session lacks: 42501 `insufficient_privilege`, or
    /// on MariaDB/MySQL 1227 (`PROCESS`, `SUPER` ...), 1142 (a table) or 1044 (a database).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn is_access_denied(error: &sqlx::Error) -> bool {
        #[cfg(feature = "mysql")]
        if let sqlx::Error::Database(e) = error {
            if let Some(e) = e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return matches!(e.number(), 1227 | 1142 | 1044);
            }
        }
        sqlstate(error).as_deref() == Some("42501")
    }

    /// An insert that found no partition for its row: 23514 `check_violation` with
    /// PostgreSQL's wording, `no partition of relation ...` (class
    /// [`Integrity`](DbError::Integrity): it fails again until the partition is created).
    #[cfg_attr(not(feature = "_broker"), allow(dead_code))]
    pub(crate) fn is_missing_partition(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Database(db) => {
                db.code().as_deref() == Some("23514") && db.message().starts_with("no partition of")
            }
            _ => false,
        }
    }
}

/// The sqlx error a [`crate::Error::Database`] holds, for the precise questions of
/// [`DbError`]; `None` for any other error (an emit's or a commit's failure included).
#[cfg_attr(not(feature = "_broker"), allow(dead_code))]
pub(crate) fn database_error(error: &crate::Error) -> Option<&sqlx::Error> {
    match error {
        crate::Error::Database(e) => Some(e),
        _ => None,
    }
}

/// The SQLSTATE the server answered `error` with, if it answered.
fn sqlstate(error: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    match error {
        sqlx::Error::Database(db) => db.code(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::DbError::{self, *};

    /// A database error with a SQLSTATE, as the server would send it.
    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            self.0
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    /// A database error with a SQLSTATE and the server's message.
    #[derive(Debug)]
    struct Said(&'static str, &'static str);

    impl std::fmt::Display for Said {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{} (SQLSTATE {})", self.1, self.0)
        }
    }

    impl std::error::Error for Said {}

    impl sqlx::error::DatabaseError for Said {
        fn message(&self) -> &str {
            self.1
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn of(code: &'static str) -> DbError {
        DbError::of(&sqlx::Error::Database(Box::new(Coded(code))))
    }

    /// Each class, with the codes that stand for it.
    #[test]
    fn each_sqlstate_class() {
        let classes: [(DbError, &[&str]); 8] = [
            (
                Unavailable,
                &[
                    "08000", "08003", "08006", "53300", "57P01", "57P02", "57P03",
                ],
            ),
            (Conflict, &["40001", "40P01"]),
            (TimedOut, &["55P03", "57014"]),
            (RolledBack, &["40000", "40002", "40003"]),
            (Aborted, &["25P02"]),
            (
                Integrity,
                &["23000", "23502", "23503", "23505", "23514", "23P01"],
            ),
            (
                Data,
                &["22000", "22001", "22003", "22012", "22P02", "22P05"],
            ),
            (
                Other,
                &["42601", "42P01", "42501", "55000", "XX000", "25001"],
            ),
        ];
        for (class, codes) in classes {
            for code in codes {
                assert_eq!(of(code), class, "SQLSTATE {code}");
            }
        }
    }

    /// Errors without a SQLSTATE: no answer is an outage, anything else is not.
    #[test]
    fn errors_without_a_sqlstate() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(DbError::of(&io), Unavailable);
        assert_eq!(DbError::of(&sqlx::Error::PoolTimedOut), Unavailable);
        assert_eq!(DbError::of(&sqlx::Error::PoolClosed), Unavailable);
        assert_eq!(DbError::of(&sqlx::Error::WorkerCrashed), Unavailable);
        assert_eq!(DbError::of(&sqlx::Error::RowNotFound), Other);
        assert_eq!(DbError::of(&sqlx::Error::Protocol("x".into())), Other);
    }

    /// What each class means to its callers: try again, the data's fault, the transaction's.
    #[test]
    fn what_each_class_means() {
        let all = [
            Unavailable,
            Conflict,
            TimedOut,
            RolledBack,
            Aborted,
            Integrity,
            Data,
            Other,
        ];
        let transient: Vec<_> = all.into_iter().filter(|c| c.is_transient()).collect();
        assert_eq!(transient, [Unavailable, Conflict, TimedOut]);
        let permanent: Vec<_> = all.into_iter().filter(|c| c.is_permanent()).collect();
        assert_eq!(permanent, [Integrity, Data]);
        let transaction: Vec<_> = all
            .into_iter()
            .filter(|c| c.is_transaction_failure())
            .collect();
        assert_eq!(transaction, [Conflict, RolledBack, Aborted]);
    }

    /// A deadlock is the transaction's failure however the handler's error wraps it: in a
    /// `sqlx::Error`, in this crate's `Error::Emit` (its source) or `Error::Database` (which
    /// displays and sources as the sqlx error it holds).
    #[test]
    fn a_deadlock_is_the_transactions_failure_in_any_wrapper() {
        let deadlock = || sqlx::Error::Database(Box::new(Coded("40P01")));
        let emit = crate::Error::Emit {
            event_type: "E".into(),
            source: deadlock(),
        };
        let is_transaction_failure = |e: &(dyn std::error::Error + 'static)| {
            DbError::find(e).is_some_and(DbError::is_transaction_failure)
        };
        assert!(is_transaction_failure(&deadlock()));
        assert!(is_transaction_failure(&emit));
        assert!(is_transaction_failure(&crate::Error::Database(deadlock())));
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(emit);
        assert_eq!(DbError::find(boxed.as_ref()), Some(Conflict));
        let plain = std::io::Error::other("not a database error");
        assert_eq!(DbError::find(&plain), None);
    }

    /// The precise questions: each answers yes to its own condition only, and the class of
    /// each error stays what `of` says.
    #[test]
    fn precise_conditions() {
        let said = |code, message| sqlx::Error::Database(Box::new(Said(code, message)));
        let no_partition = said(
            "23514",
            "no partition of relation \"processed_event\" found for row",
        );
        let other_check = said("23514", "new row violates check constraint \"c\"");
        let undefined = said("42P01", "relation \"outbox_partition_kept\" does not exist");
        let lock = said("55P03", "canceling statement due to lock timeout");
        let statement = said("57014", "canceling statement due to statement timeout");
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));

        assert!(DbError::is_missing_partition(&no_partition));
        for e in [&other_check, &undefined, &lock, &statement, &io] {
            assert!(!DbError::is_missing_partition(e), "{e}");
        }
        assert!(DbError::is_undefined_table(&undefined));
        for e in [&no_partition, &other_check, &lock, &statement, &io] {
            assert!(!DbError::is_undefined_table(e), "{e}");
        }
        assert!(DbError::is_lock_not_available(&lock));
        for e in [&no_partition, &other_check, &undefined, &statement, &io] {
            assert!(!DbError::is_lock_not_available(e), "{e}");
        }

        assert_eq!(DbError::of(&no_partition), Integrity);
        assert_eq!(DbError::of(&undefined), Other);
        assert_eq!(DbError::of(&lock), TimedOut);
    }

    /// Only this crate's `Error::Database` gives its sqlx error to the precise questions.
    #[test]
    fn the_database_error_of_a_crate_error() {
        let no_partition = || {
            sqlx::Error::Database(Box::new(Said(
                "23514",
                "no partition of relation \"inbox_event\" found for row",
            )))
        };
        let database = crate::Error::Database(no_partition());
        assert!(super::database_error(&database).is_some_and(DbError::is_missing_partition));
        let emit = crate::Error::Emit {
            event_type: "E".into(),
            source: no_partition(),
        };
        assert!(super::database_error(&emit).is_none());
    }
}
