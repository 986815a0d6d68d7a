\set k random(1, 9000000000000000000)
BEGIN;
SAVEPOINT s;
WITH live AS (SELECT token, completed, fingerprint, value FROM "idem_bench" WHERE key = sha256(int8send(:k)) AND expires_at > clock_timestamp()), claimed AS (INSERT INTO "idem_bench" AS r (key, token, completed, fingerprint, value, expires_at) SELECT sha256(int8send(:k)), nextval('"idem_bench_token"'), false, NULL, NULL, clock_timestamp() + 60000 * interval '1 millisecond' WHERE NOT EXISTS (SELECT 1 FROM live) ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, completed = false, fingerprint = EXCLUDED.fingerprint, value = EXCLUDED.value, expires_at = EXCLUDED.expires_at WHERE r.expires_at <= clock_timestamp() RETURNING r.token, r.completed, r.fingerprint, r.value) SELECT true, token, completed, fingerprint, value FROM claimed UNION ALL SELECT false, token, completed, fingerprint, value FROM live;
UPDATE pgb_ledger SET balance = balance - 1 WHERE id = 1;
UPDATE pgb_ledger SET balance = balance + 1 WHERE id = 2;
UPDATE idem_bench SET completed = true, value = decode('7b226964223a372c22637573746f6d6572223a226375735f30303432222c2263656e7473223a343939397d7b226964223a372c22637573746f6d6572223a226375735f30303432222c2263656e7473223a343939397d','hex'), expires_at = clock_timestamp() + 86400000 * interval '1 millisecond' WHERE key = sha256(int8send(:k)) AND NOT completed RETURNING true;
RELEASE SAVEPOINT s;
COMMIT;
