-- pollbridge's views over Apache Airflow's serialized DAGs: the dependency edges and trigger rules of every
-- task, per DAG version, for pollbridge to decide readiness of Airflow's task_instance rows.
--
-- Assumes Apache Airflow 3.3 on PostgreSQL (checked against 3.3.2), with serialized_dag.data as JSON of
-- serializer __version 3:
--   data -> 'dag' -> 'tasks'   an array with one element per task of the DAG, task groups flattened (a task
--                              in nested groups has its full id, e.g. 'outer.inner.t'; dependencies set on a
--                              group are resolved to task-level edges), each {"__type": "operator",
--                              "__var": {...}} (an element without the "__var" wrapper is read as is).
--   __var -> 'task_id'              the task id, as task_instance.task_id;
--   __var -> 'downstream_task_ids'  the ids of the tasks that depend on it; omitted when there are none.
--                                   The serialization has no upstream list: edges are read from this side.
--   __var -> 'trigger_rule'         omitted when it is the default 'all_success'; a mapped task
--                                   ("_is_mapped": true) keeps it in __var -> 'partial_kwargs' instead, and a
--                                   DAG may carry SDK-wide task defaults in data -> 'client_defaults' -> 'tasks'.
-- Every view is keyed by (dag_version_id, task_id): a task_instance row (which has dag_version_id, dag_id,
-- task_id) finds its rule and its upstream edges with an equality join on those two columns.
--
-- With [core] compress_serialized_dags = True Airflow leaves serialized_dag.data NULL and writes the
-- zlib-compressed JSON to data_compressed, which SQL cannot read: the views then return no row for those
-- DAG versions. The block check reports such rows; pollbridge's doctor prints its rows.
--
-- Installed by a role that can read Airflow's serialized_dag table, in Airflow's database, after
-- `airflow db migrate`; it never writes Airflow's tables. The blocks contain no '$' (they may be loaded as
-- string.Template texts like bridge/db/sql/*.sql).

-- name: install
-- One row per task of every serialized DAG version: the base of the two views pollbridge reads.
CREATE OR REPLACE VIEW pollbridge_airflow_tasks AS
SELECT s.dag_version_id,
       s.dag_id,
       (op.body ->> 'task_id')::varchar AS task_id,
       COALESCE(op.body ->> 'trigger_rule',
                op.body -> 'partial_kwargs' ->> 'trigger_rule',
                s.data::jsonb -> 'client_defaults' -> 'tasks' ->> 'trigger_rule',
                'all_success')::varchar AS trigger_rule,
       CASE WHEN jsonb_typeof(op.body -> 'downstream_task_ids') = 'array'
            THEN op.body -> 'downstream_task_ids' ELSE '[]'::jsonb END AS downstream_task_ids
FROM serialized_dag AS s
CROSS JOIN LATERAL jsonb_array_elements(
       CASE WHEN jsonb_typeof(s.data::jsonb -> 'dag' -> 'tasks') = 'array'
            THEN s.data::jsonb -> 'dag' -> 'tasks' ELSE '[]'::jsonb END) AS element(value)
CROSS JOIN LATERAL (SELECT COALESCE(element.value -> '__var', element.value) AS body) AS op
WHERE s.data IS NOT NULL;

-- One row per task: its trigger rule.
CREATE OR REPLACE VIEW pollbridge_airflow_rules AS
SELECT dag_version_id, dag_id, task_id, trigger_rule
FROM pollbridge_airflow_tasks;

-- One row per dependency edge: task_id depends on upstream_task_id in that DAG version; trigger_rule is
-- task_id's (the downstream task's). A LEFT JOIN: an edge to a task missing from the same version (never
-- seen) is kept with a NULL rule rather than dropped, since a dropped edge would make a task look ready early.
CREATE OR REPLACE VIEW pollbridge_airflow_edges AS
SELECT up.dag_version_id,
       up.dag_id,
       downstream.task_id::varchar AS task_id,
       up.task_id AS upstream_task_id,
       down.trigger_rule
FROM pollbridge_airflow_tasks AS up
CROSS JOIN LATERAL jsonb_array_elements_text(up.downstream_task_ids) AS downstream(task_id)
LEFT JOIN pollbridge_airflow_tasks AS down
       ON down.dag_version_id = up.dag_version_id AND down.task_id = downstream.task_id;

-- name: uninstall
DROP VIEW IF EXISTS pollbridge_airflow_edges;
DROP VIEW IF EXISTS pollbridge_airflow_rules;
DROP VIEW IF EXISTS pollbridge_airflow_tasks;

-- name: check
-- pollbridge doctor: one row per problem (none when all is well). Serialized DAG versions the views cannot
-- read ([core] compress_serialized_dags = True leaves data NULL).
SELECT count(*) || ' serialized DAG version(s) are compressed, which pollbridge cannot read: set '
       || '[core] compress_serialized_dags = False (AIRFLOW__CORE__COMPRESS_SERIALIZED_DAGS=False) and run '
       || '`airflow dags reserialize`' AS problem
  FROM serialized_dag WHERE data IS NULL HAVING count(*) > 0;
