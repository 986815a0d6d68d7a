-- See replay_setup.sql.
\set k random(1, 10000)
WITH live AS (SELECT completed, value FROM rp_base WHERE key = :k AND expires_at > now() AND sha256(int8send(:k)) IS NOT NULL), claimed AS (INSERT INTO rp_base (key, completed, expires_at) SELECT :k, false, now() + interval '30 seconds' WHERE NOT EXISTS (SELECT 1 FROM live) ON CONFLICT (key) DO NOTHING RETURNING completed, value) SELECT completed, value FROM live UNION ALL SELECT completed, value FROM claimed;
