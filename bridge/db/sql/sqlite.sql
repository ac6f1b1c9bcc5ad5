-- Capture on SQLite. Same placeholders as postgresql.sql; SQLite has no functions, so each trigger
-- carries the whole INSERT, and there is no NOTIFY (the embedded relay probes the outbox).

-- name: insert_trigger
CREATE TRIGGER pollbridge_capture_insert AFTER INSERT ON $table
FOR EACH ROW
BEGIN
  INSERT INTO pollbridge_outbox
    (event_id, task_id, instance_id, workflow_type, task_key, change, old_status, new_status,
     trace_id, relay_partition, created_at)
  SELECT lower(substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-' ||
               substr(h, 17, 4) || '-' || substr(h, 21, 12)),
         CAST(NEW.$id AS TEXT), CAST(NEW.$instance_id AS TEXT), $type_expr, CAST(NEW.$task_key AS TEXT),
         'insert', NULL, CAST(NEW.$status AS TEXT), lower(hex(randomblob(16))), 0,
         strftime('%Y-%m-%d %H:%M:%f', 'now')
  FROM (SELECT hex(randomblob(16)) AS h);
END

-- name: update_trigger
CREATE TRIGGER pollbridge_capture_update AFTER UPDATE ON $table
FOR EACH ROW WHEN $changed
BEGIN
  INSERT INTO pollbridge_outbox
    (event_id, task_id, instance_id, workflow_type, task_key, change, old_status, new_status,
     trace_id, relay_partition, created_at)
  SELECT lower(substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-' ||
               substr(h, 17, 4) || '-' || substr(h, 21, 12)),
         CAST(NEW.$id AS TEXT), CAST(NEW.$instance_id AS TEXT), $type_expr, CAST(NEW.$task_key AS TEXT),
         $change_kind, CAST(OLD.$status AS TEXT), CAST(NEW.$status AS TEXT), lower(hex(randomblob(16))), 0,
         strftime('%Y-%m-%d %H:%M:%f', 'now')
  FROM (SELECT hex(randomblob(16)) AS h);
END

-- name: list_triggers
SELECT name, tbl_name AS table_name FROM sqlite_master WHERE type = 'trigger' AND name LIKE 'pollbridge\_%' ESCAPE '\'

-- name: drop_trigger
DROP TRIGGER IF EXISTS $name
