-- The demo e-commerce schema: users (personal data, home region), items (shared),
-- events (personal: a user's views, clicks, carts and purchases).
CREATE TABLE IF NOT EXISTS public.users (
    user_id     bigint PRIMARY KEY,
    home_region text NOT NULL,          -- eu-west | us-east | ap-southeast
    country     char(2) NOT NULL,
    segment     smallint NOT NULL DEFAULT 0,
    email       text NOT NULL,          -- never captured (exclude_columns)
    signup_at   timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS public.items (
    item_id     bigint PRIMARY KEY,
    category_id integer NOT NULL,
    price       numeric(10, 2) NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS public.events (
    event_id    bigserial PRIMARY KEY,
    user_id     bigint NOT NULL,
    item_id     bigint NOT NULL,
    category_id integer NOT NULL,       -- copied from the item, as event logs usually do
    price       numeric(10, 2) NOT NULL,
    home_region text NOT NULL,          -- the user's home region, copied for routing
    kind        text NOT NULL CHECK (kind IN ('view', 'click', 'add_to_cart', 'purchase')),
    occurred_at timestamptz NOT NULL DEFAULT now()
);
