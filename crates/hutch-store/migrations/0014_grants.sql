-- Each key's grant secret (32 random bytes, hex): the HMAC key of the
-- grants its holder mints for end users (`hg_` tokens). NULL until the
-- key mints its first grant; replaced by a rotation, which revokes every
-- grant made under the old one. Grants themselves are never stored.
ALTER TABLE api_keys ADD COLUMN grant_secret TEXT;
