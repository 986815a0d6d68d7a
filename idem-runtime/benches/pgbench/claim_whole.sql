\set k random(1, 9000000000000000000)
BEGIN;
SAVEPOINT s;
SELECT * FROM pgb_claim_whole(sha256(int8send(:k)), NULL, 60000, '5000ms');
UPDATE pgb_ledger SET balance = balance - 1 WHERE id = 1;
UPDATE pgb_ledger SET balance = balance + 1 WHERE id = 2;
UPDATE idem_bench SET completed = true, value = decode('7b226964223a372c22637573746f6d6572223a226375735f30303432222c2263656e7473223a343939397d7b226964223a372c22637573746f6d6572223a226375735f30303432222c2263656e7473223a343939397d','hex'), expires_at = clock_timestamp() + 86400000 * interval '1 millisecond' WHERE key = sha256(int8send(:k)) AND NOT completed RETURNING true;
RELEASE SAVEPOINT s;
COMMIT;
