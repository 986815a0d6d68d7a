-- See replay_setup.sql.
\set k random(1, 10000)
WITH live AS (SELECT completed, value FROM rp_base_wide WHERE key = sha256(int8send(:k)) AND expires_at > now()), claimed AS (INSERT INTO rp_base_wide (key, completed, expires_at) SELECT sha256(int8send(:k)), false, now() + interval '30 seconds' WHERE NOT EXISTS (SELECT 1 FROM live) ON CONFLICT (key) DO NOTHING RETURNING completed, value) SELECT completed, value FROM live UNION ALL SELECT completed, value FROM claimed;
