-- See replay_setup.sql.
\set k random(1, 10000)
\set n random(1, 1000000000)
SELECT * FROM rp_claim(sha256(int8send(:k)), NULL, 60000, 5000, int8send(:n));
