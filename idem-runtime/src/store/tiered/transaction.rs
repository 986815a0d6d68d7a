//! A tier whose durable store claims inside the caller's transaction (features `postgres`,
//! `sqlite`, `mysql`): `transaction = tx` with a `TieredStore` of Redis (or memory) over
//! PostgreSQL, SQLite or MySQL. The claim, the body's writes and the record commit in the
//! caller's transaction, in the durable store; a replay is served from the fast tier once
//! a copy is there, without a savepoint or a statement on the caller's connection.
//!
//! A record written in a transaction is visible only once the caller commits, so it is
//! not copied then: the first replay that finds it in the durable store copies it.

use std::time::Duration;

use bytes::Bytes;

use super::TieredStore;
use crate::store::transaction::{sealed::Sealed, Call, Transactional};
use crate::{Claim, Error, Fingerprint, Key, Store, Token};

impl<F: Store + Clone, D: Transactional> Sealed for TieredStore<F, D> {}

impl<F: Store + Clone, D: Transactional> Transactional for TieredStore<F, D> {
    type Connection = D::Connection;

    async fn __recorded(&self, key: &Key) -> Option<(Bytes, Option<Fingerprint>)> {
        self.read_fast(key)
            .await
            .map(|copy| (copy.value, copy.fingerprint))
    }

    async fn __claim_in(
        &self,
        connection: &mut Self::Connection,
        call: &Call<'_>,
        first: bool,
    ) -> Result<Claim, Error> {
        let claim = self.durable.__claim_in(connection, call, first).await?;
        if let Claim::Completed { fingerprint, .. } = &claim {
            // Committed by another transaction: copied, for the next replays.
            self.copy(call.key, fingerprint.as_ref()).await;
        }
        Ok(claim)
    }

    async fn __before_polling(&self, connection: &mut Self::Connection) -> Result<(), Error> {
        self.durable.__before_polling(connection).await
    }

    async fn __complete_in(
        &self,
        connection: &mut Self::Connection,
        call: &Call<'_>,
        token: Token,
        record: &[u8],
        ttl: Duration,
    ) -> Result<bool, Error> {
        self.durable
            .__complete_in(connection, call, token, record, ttl)
            .await
    }

    async fn __roll_back(&self, connection: &mut Self::Connection, call: &Call<'_>) {
        self.durable.__roll_back(connection, call).await;
    }
}
