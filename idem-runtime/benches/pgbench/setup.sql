-- Tables and functions for the pgbench scripts beside this file (BENCHMARKS.md, P12a).
-- Run the paths bench once first: its `idem_bench` table, sequence and claim function
-- (`idem_bench_claim_in_transaction`) are PostgresStore::migrate()'s.
CREATE TABLE IF NOT EXISTS pgb_ledger (id int PRIMARY KEY, balance bigint NOT NULL);
INSERT INTO pgb_ledger VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING;
-- The floor's table, without and with an index on the expiry.
CREATE TABLE IF NOT EXISTS pgb_raw (key bytea PRIMARY KEY, value bytea, expires_at timestamptz);
CREATE TABLE IF NOT EXISTS pgb_rawx (key bytea PRIMARY KEY, value bytea, expires_at timestamptz);
CREATE INDEX IF NOT EXISTS pgb_rawx_exp ON pgb_rawx (expires_at);

-- The claim before 2026-11-28's fourth round: the whole claim for every key.
CREATE OR REPLACE FUNCTION pgb_claim_whole(p_key bytea, p_fingerprint bytea, p_lease bigint, p_lock_timeout text)
RETURNS TABLE (acquired boolean, token bigint, completed boolean, fingerprint bytea, value bytea)
LANGUAGE plpgsql SET lock_timeout = 0 AS $idem$
#variable_conflict use_column
BEGIN
PERFORM set_config('lock_timeout', p_lock_timeout, true);
FOR attempt IN 1..1000 LOOP
RETURN QUERY WITH live AS (SELECT token, completed, fingerprint, value FROM "idem_bench" WHERE key = p_key AND expires_at > clock_timestamp()), claimed AS (INSERT INTO "idem_bench" AS r (key, token, completed, fingerprint, value, expires_at) SELECT p_key, nextval('"idem_bench_token"'), false, p_fingerprint, NULL, clock_timestamp() + p_lease * interval '1 millisecond' WHERE NOT EXISTS (SELECT 1 FROM live) ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, completed = false, fingerprint = EXCLUDED.fingerprint, value = EXCLUDED.value, expires_at = EXCLUDED.expires_at WHERE r.expires_at <= clock_timestamp() RETURNING r.token, r.completed, r.fingerprint, r.value) SELECT true, token, completed, fingerprint, value FROM claimed UNION ALL SELECT false, token, completed, fingerprint, value FROM live;
IF FOUND THEN RETURN; END IF;
END LOOP;
RAISE EXCEPTION 'idem: the claim of a key did not settle after 1000 attempts';
END

$idem$;

-- The same without the function's SET clause, the setting put back by hand.
CREATE OR REPLACE FUNCTION pgb_claim_no_set(p_key bytea, p_fingerprint bytea, p_lease bigint, p_lock_timeout text)
RETURNS TABLE (acquired boolean, token bigint, completed boolean, fingerprint bytea, value bytea)
LANGUAGE plpgsql AS $idem$
#variable_conflict use_column
DECLARE prev text := current_setting('lock_timeout');
BEGIN
PERFORM set_config('lock_timeout', p_lock_timeout, true);
FOR attempt IN 1..1000 LOOP
RETURN QUERY WITH live AS (SELECT token, completed, fingerprint, value FROM "idem_bench" WHERE key = p_key AND expires_at > clock_timestamp()), claimed AS (INSERT INTO "idem_bench" AS r (key, token, completed, fingerprint, value, expires_at) SELECT p_key, nextval('"idem_bench_token"'), false, p_fingerprint, NULL, clock_timestamp() + p_lease * interval '1 millisecond' WHERE NOT EXISTS (SELECT 1 FROM live) ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, completed = false, fingerprint = EXCLUDED.fingerprint, value = EXCLUDED.value, expires_at = EXCLUDED.expires_at WHERE r.expires_at <= clock_timestamp() RETURNING r.token, r.completed, r.fingerprint, r.value) SELECT true, token, completed, fingerprint, value FROM claimed UNION ALL SELECT false, token, completed, fingerprint, value FROM live;
IF FOUND THEN PERFORM set_config('lock_timeout', prev, true); RETURN; END IF;
END LOOP;
RAISE EXCEPTION 'idem: the claim of a key did not settle after 1000 attempts';
END

$idem$;
