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
