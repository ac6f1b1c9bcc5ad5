-- Capture on PostgreSQL. Placeholders: $table (qualified, quoted task table), $id, $instance_id,
-- $task_key, $status (quoted NEW/OLD column names), $type_expr (the workflow type of NEW),
-- $changed (boolean: a mapped column other than status changed), $change_kind (text expression),
-- $partition_expr (relay partition of NEW), $notify (statement or empty).

-- name: capture_function
CREATE OR REPLACE FUNCTION pollbridge_capture() RETURNS trigger
LANGUAGE plpgsql AS $$$$
BEGIN
  INSERT INTO pollbridge_outbox
    (event_id, task_id, instance_id, workflow_type, task_key, change, old_status, new_status,
     trace_id, relay_partition, created_at)
  VALUES
    (gen_random_uuid()::text, NEW.$id::text, NEW.$instance_id::text, $type_expr, NEW.$task_key::text,
     CASE WHEN TG_OP = 'INSERT' THEN 'insert' ELSE $change_kind END,
     CASE WHEN TG_OP = 'UPDATE' THEN OLD.$status::text END, NEW.$status::text,
     replace(gen_random_uuid()::text, '-', ''), $partition_expr, clock_timestamp());
  $notify
  RETURN NULL;
END
$$$$

-- name: insert_trigger
CREATE TRIGGER pollbridge_capture_insert AFTER INSERT ON $table
FOR EACH ROW EXECUTE FUNCTION pollbridge_capture()

-- name: update_trigger
CREATE TRIGGER pollbridge_capture_update AFTER UPDATE ON $table
FOR EACH ROW WHEN ($changed) EXECUTE FUNCTION pollbridge_capture()

-- name: notify_always
PERFORM pg_notify('pollbridge_outbox', '');

-- name: notify_when_armed
IF EXISTS (SELECT 1 FROM pollbridge_relay_state WHERE relay_partition = $partition_expr AND armed) THEN
    PERFORM pg_notify('pollbridge_outbox', '');
  END IF;

-- name: list_triggers
SELECT t.tgname AS name, t.tgrelid::regclass::text AS table_name
FROM pg_trigger t WHERE NOT t.tgisinternal AND left(t.tgname, 11) = 'pollbridge_'

-- name: drop_trigger
DROP TRIGGER IF EXISTS $name ON $table

-- name: drop_function
DROP FUNCTION IF EXISTS pollbridge_capture() CASCADE

-- Routing (migration 0005). The bucket is the frozen hash documented in bridge/routing.py: the first
-- 32 bits of md5(workflow_type || '/' || instance_id), modulo 10000. Never change it: instances
-- would move in and out of a selective percentage.

-- name: bucket_function
CREATE OR REPLACE FUNCTION pollbridge_bucket(workflow_type text, instance_id text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$$$
  SELECT (('x' || substr(md5(coalesce(workflow_type, '') || '/' || instance_id), 1, 8))::bit(32)::bigint
          % 10000)::integer
$$$$

-- name: should_handle_function
CREATE OR REPLACE FUNCTION pollbridge_poller_should_handle(workflow_type text, instance_id text,
                                                           ready_since timestamptz) RETURNS boolean
LANGUAGE sql STABLE AS $$$$
  SELECT CASE coalesce(f.phase, 'polling')
    WHEN 'selective' THEN
      NOT (f.percent IS NULL OR pollbridge_bucket($$1, $$2) < round(f.percent * 100))
      OR $$3 IS NULL OR $$3 <= clock_timestamp() - make_interval(secs => f.grace_seconds)
    WHEN 'cutover' THEN false
    ELSE true
  END
  FROM (SELECT 1) AS one LEFT JOIN pollbridge_flags AS f ON f.workflow_type = $$1
$$$$

-- name: drop_should_handle_function
DROP FUNCTION IF EXISTS pollbridge_poller_should_handle(text, text, timestamptz)

-- name: drop_bucket_function
DROP FUNCTION IF EXISTS pollbridge_bucket(text, text)
