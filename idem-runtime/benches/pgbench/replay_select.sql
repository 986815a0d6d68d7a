-- See replay_setup.sql.
\set k random(1, 10000)
SELECT completed, value FROM rp_base WHERE key = :k AND expires_at > now();
