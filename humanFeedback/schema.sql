-- Schema of <data-dir>/feedback.sqlite3, applied by humanFeedback/feedback_server.py at every start.
--
-- Every statement is IF NOT EXISTS / OR IGNORE: a data dir written by an older server keeps its tables
-- as they are (SQLite cannot add constraints to an existing table) and is served unchanged; the
-- constraints below hold for databases created from this file.  The server checks every value before it
-- writes, so these constraints are the last line, not the error messages users see.
--
-- No STRICT tables: they need SQLite 3.37, newer than what some cluster distributions ship.

CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL UNIQUE CHECK (length(name) > 0),
    env_id TEXT CHECK (env_id IS NULL OR length(env_id) > 0),
    created_at TEXT NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'  -- a JSON object
);

-- A pair of clips to compare.  session and the segment ids are the trainer's own, an integer or a string,
-- and must come back exactly as sent: a column declared INTEGER or TEXT would turn the string '3' into
-- the integer 3 or the other way round (SQLite's type affinity), so these columns declare no type and
-- the CHECK on typeof() is their type.
CREATE TABLE IF NOT EXISTS queries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    session NOT NULL CHECK (typeof(session) IN ('integer', 'text')),
    left_clip TEXT NOT NULL CHECK (length(left_clip) > 0),
    right_clip TEXT NOT NULL CHECK (length(right_clip) > 0),
    left_segment_id NOT NULL CHECK (typeof(left_segment_id) IN ('integer', 'text')),
    right_segment_id NOT NULL CHECK (typeof(right_segment_id) IN ('integer', 'text')),
    created_at TEXT NOT NULL,
    -- who the pair is shown to, until when (seconds since the epoch); both set or both NULL.  lease_holder is whose lease
    -- it is (access.Principal.holder: a browser's session, or the token's annotator name), lease_annotator the name given
    lease_annotator TEXT,
    lease_expires REAL,
    lease_holder TEXT,
    rating_scale INTEGER CHECK (rating_scale IS NULL OR (typeof(rating_scale) = 'integer' AND rating_scale BETWEEN 2 AND 10)),
    -- the step of the reward-model check whose clips this query holds, to be reordered from the check view (never
    -- leased by /api/next); NULL for the queries the trainer asks
    check_step INTEGER CHECK (check_step IS NULL OR (typeof(check_step) = 'integer' AND check_step >= 0)),
    CHECK (left_clip <> right_clip),
    CHECK ((lease_annotator IS NULL) = (lease_expires IS NULL)),
    UNIQUE (run_id, left_clip, right_clip)
);

-- The clips of a query of more than two (a ranking) or of clips to rate (its rating_scale set): every one, in the order
-- shown, with its segment id.  Such a query's left and right columns hold its first two clips; a pair has no rows here.
CREATE TABLE IF NOT EXISTS query_clips (
    query_id INTEGER NOT NULL REFERENCES queries(id),
    position INTEGER NOT NULL CHECK (position >= 0),
    clip TEXT NOT NULL CHECK (length(clip) > 0),
    segment_id NOT NULL CHECK (typeof(segment_id) IN ('integer', 'text')),
    PRIMARY KEY (query_id, position),
    UNIQUE (query_id, clip)
);

-- The current answer to a query, at most one; seq orders every label write (see label_tombstones).  A pair's answer is
-- its choice; a ranking's is choice 'ranked' with ranking, the JSON list of its clips' positions, best first; ratings'
-- are choice 'rated' with ratings, the JSON list of each clip's rating in the order shown (either may be 'skip').
CREATE TABLE IF NOT EXISTS labels (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    query_id INTEGER NOT NULL UNIQUE REFERENCES queries(id),
    choice TEXT NOT NULL CHECK (choice IN ('left', 'right', 'tie', 'skip', 'ranked', 'rated')),
    annotator TEXT NOT NULL CHECK (length(annotator) > 0),
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    seq INTEGER NOT NULL UNIQUE CHECK (seq > 0),
    holder TEXT,  -- who gave it (access.Principal.holder): only they may change or undo it
    ranking TEXT,
    ratings TEXT,
    CHECK ((choice = 'ranked') = (ranking IS NOT NULL)),
    CHECK ((choice = 'rated') = (ratings IS NOT NULL))
);

-- An undone label, kept so that a reader of answers?after= learns that it is gone.  label_id names a
-- row that no longer exists in labels, hence no REFERENCES.
CREATE TABLE IF NOT EXISTS label_tombstones (
    seq INTEGER PRIMARY KEY CHECK (seq > 0),
    label_id INTEGER NOT NULL,
    query_id INTEGER NOT NULL REFERENCES queries(id),
    choice TEXT NOT NULL CHECK (choice IN ('left', 'right', 'tie', 'skip', 'ranked', 'rated')),
    annotator TEXT NOT NULL CHECK (length(annotator) > 0),
    created_at TEXT NOT NULL,
    deleted_at TEXT NOT NULL,
    ranking TEXT,
    ratings TEXT
);

-- A clip shown in the reward-model check view (#rewards) with the return the reward model predicts.
CREATE TABLE IF NOT EXISTS evaluations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    clip TEXT NOT NULL CHECK (length(clip) > 0),
    predicted_return REAL NOT NULL CHECK (typeof(predicted_return) = 'real'),
    step INTEGER NOT NULL CHECK (typeof(step) = 'integer' AND step >= 0),
    created_at TEXT NOT NULL,
    -- 'check': a segment with the reward model's predicted return (the reward view ranks them); 'agent': the start of
    -- an evaluation episode with its mean return (what the agent does now, shown beside the pairs)
    kind TEXT NOT NULL DEFAULT 'check' CHECK (kind IN ('check', 'agent')),
    UNIQUE (run_id, clip)
);

-- Named counters; 'label' is the global seq of label writes.
CREATE TABLE IF NOT EXISTS sequence (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL CHECK (value >= 0)
);
INSERT OR IGNORE INTO sequence (name, value) VALUES ('label', 0);

CREATE INDEX IF NOT EXISTS queries_run ON queries (run_id, session);
CREATE INDEX IF NOT EXISTS tombstones_query ON label_tombstones (query_id);

-- What the trainer of a run last reported (POST /api/runs/<run_id>/progress): its step, whether it is training or
-- waiting for labels, roughly when the next session comes.  report is the JSON object as the server checked it;
-- reported_at is the server's clock (seconds since the epoch), so the page can say how old the news is.
CREATE TABLE IF NOT EXISTS run_progress (
    run_id INTEGER PRIMARY KEY REFERENCES runs(id),
    report TEXT NOT NULL,
    reported_at REAL NOT NULL
);

-- How many pairs a session will have, as the trainer declared before uploading them one by one: the page's
-- "pair k of N" uses it, not the number uploaded so far.
CREATE TABLE IF NOT EXISTS session_sizes (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    session NOT NULL CHECK (typeof(session) IN ('integer', 'text')),
    size INTEGER NOT NULL CHECK (typeof(size) = 'integer' AND size >= 0),
    PRIMARY KEY (run_id, session)
);

-- Invitations (humanFeedback/access.py): every login code, as the hash of its code, its role (the trainer's own link, or
-- an annotator's) and until when it works unless used.  Using it sets used_at (a code works once, also across restarts
-- of the server); revoking it sets revoked_at, which also logs out the browsers it let in.  Times in seconds since the
-- epoch.
CREATE TABLE IF NOT EXISTS invitations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    role TEXT NOT NULL CHECK (role IN ('trainer', 'annotator')),
    name TEXT NOT NULL DEFAULT '',
    code_hash TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    used_at REAL,
    revoked_at REAL
);
