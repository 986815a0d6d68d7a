-- Tables and a function for the replay scripts beside this file (BENCHMARKS.md, throughput,
-- 2026-11-29): 10 000 completed records in a table shaped as PostgresStore's (rp_idem) and
-- in the throughput bench's baseline table (rp_base). Each script alone, one after another,
-- three rounds:
--   psql -h 127.0.0.1 -U postgres test -f replay_setup.sql
--   for round in 1 2 3; do
--     for s in replay_select replay_floor replay_whole replay_skip replay_function; do
--       pgbench -h 127.0.0.1 -U postgres -n -c 16 -j 2 -T 5 -M prepared -f $s.sql test; done; done
-- Fresh claims on one client (BENCHMARKS.md: the function against the whole claim): the
-- same scripts with `random(1, 10000)` changed to `random(20000, 9000000000000000000)`, run
-- with `-c 1 -T 4` in place of `-c 16 -j 2 -T 5`.
-- The floor's key width (BENCHMARKS.md, eighth round): replay_floor_hashed (the floor's
-- bigint key, the digest computed as the others do) against replay_floor_wide (the floor on
-- rp_base_wide, keyed by the 32-byte digest as idem is) and replay_skip, with the loop above.
DROP TABLE IF EXISTS rp_idem, rp_base, rp_base_wide;
DROP SEQUENCE IF EXISTS rp_idem_token;
CREATE TABLE rp_idem (key bytea PRIMARY KEY, token bigint NOT NULL, completed boolean NOT NULL,
    fingerprint bytea, value bytea, expires_at timestamptz NOT NULL);
CREATE INDEX rp_idem_expires_at ON rp_idem (expires_at);
CREATE SEQUENCE rp_idem_token;
CREATE TABLE rp_base (key bigint PRIMARY KEY, completed boolean NOT NULL, value bytea,
    expires_at timestamptz NOT NULL);
INSERT INTO rp_idem SELECT sha256(int8send(g)), g, true, NULL,
    convert_to('{"id":7,"customer":"cus_0042","cents":4999}', 'UTF8'), now() + interval '1 day'
    FROM generate_series(1, 10000) g;
INSERT INTO rp_base SELECT g, true,
    convert_to('{"id":7,"customer":"cus_0042","cents":4999}', 'UTF8'), now() + interval '1 day'
    FROM generate_series(1, 10000) g;
CREATE TABLE rp_base_wide (key bytea PRIMARY KEY, completed boolean NOT NULL, value bytea,
    expires_at timestamptz NOT NULL);
INSERT INTO rp_base_wide SELECT sha256(int8send(g)), true,
    convert_to('{"id":7,"customer":"cus_0042","cents":4999}', 'UTF8'), now() + interval '1 day'
    FROM generate_series(1, 10000) g;
VACUUM ANALYZE rp_base_wide;
VACUUM ANALYZE rp_idem;
VACUUM ANALYZE rp_base;

-- The design measured and not taken: the claim as a PL/pgSQL function that reads first.
CREATE OR REPLACE FUNCTION rp_claim(p_key bytea, p_fingerprint bytea, p_lease bigint,
    p_lock_timeout bigint, p_nonce bytea)
RETURNS TABLE (acquired boolean, token bigint, completed boolean, fingerprint bytea, value bytea)
LANGUAGE plpgsql AS $idem$
#variable_conflict use_column
DECLARE taken bigint;
BEGIN
  RETURN QUERY SELECT false, token, completed, fingerprint, value FROM rp_idem
    WHERE key = p_key AND expires_at > now() AND (completed OR value IS DISTINCT FROM p_nonce);
  IF FOUND THEN RETURN; END IF;
  INSERT INTO rp_idem (key, token, completed, fingerprint, value, expires_at)
    SELECT p_key, nextval('rp_idem_token'), false, p_fingerprint, p_nonce,
      now() + p_lease * interval '1 millisecond'
    WHERE set_config('lock_timeout', p_lock_timeout::text, true) IS NOT NULL
    ON CONFLICT (key) DO NOTHING RETURNING token INTO taken;
  IF taken IS NOT NULL THEN
    acquired := true; token := taken; completed := false; fingerprint := p_fingerprint;
    value := p_nonce;
    RETURN NEXT;
    RETURN;
  END IF;
  RAISE EXCEPTION 'the whole claim is left out of this measurement';
END
$idem$;
