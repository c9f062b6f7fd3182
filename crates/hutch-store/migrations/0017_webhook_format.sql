-- A webhook's payload format and signature scheme: 'native' (hutch's event
-- JSON, `Hutch-Signature`) or 'e2b' (E2B's lifecycle payload,
-- `e2b-signature`); its name (E2B's), and whether it gets new deliveries
-- (a disabled one gets none; what is pending is still sent).
ALTER TABLE webhooks ADD COLUMN format TEXT NOT NULL DEFAULT 'native';
ALTER TABLE webhooks ADD COLUMN name TEXT NOT NULL DEFAULT '';
ALTER TABLE webhooks ADD COLUMN enabled INTEGER NOT NULL DEFAULT 1;
